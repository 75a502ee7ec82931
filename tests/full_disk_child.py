"""A `train_and_evaluate` flow run in a process none of whose files may grow past N bytes.

``python full_disk_child.py LIMIT_BYTES PROGRAM JOB STORAGE MAX_STEPS EVERY MLFLOW_URI``; a
LIMIT_BYTES of 0 runs without a limit. The limit is RLIMIT_FSIZE: a write past it fails with EFBIG
from the kernel, a real write failure as a full disk's ENOSPC is, without root or a mount. This
process is the test's own, so it ignores SIGXFSZ (else the kernel kills it at the first such
write). Prints the flow's summary as JSON on its last line.
"""

import json
import resource
import signal
import sys

limit, program, job, storage, max_steps, every, mlflow_uri = sys.argv[1:8]
if int(limit):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.RLIM_INFINITY))

from prefect_jax.flows import train_and_evaluate  # noqa: E402
from prefect_jax.training.specs import (  # noqa: E402
    CheckpointSpec,
    EvalSpec,
    LatestExporter,
    RetrySpec,
    TrainSpec,
)

summary = train_and_evaluate(
    program=program,
    job=job,
    storage=storage,
    train_spec=TrainSpec(max_steps=int(max_steps), log_every_steps=10),
    eval_spec=EvalSpec(exporters=[LatestExporter()]),
    checkpoint_spec=CheckpointSpec(every_steps=int(every), keep_last=10),
    mlflow_tracking_uri=mlflow_uri,
    retry_spec=RetrySpec(retries=1, eval_retries=0, retry_delay_seconds=0.1),
)
print(json.dumps(summary, default=str))
