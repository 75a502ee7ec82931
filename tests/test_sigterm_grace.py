"""SIGTERM with a grace period too short for the save: the save is abandoned cleanly and the
newest valid checkpoint is restored, never a torn one (a real process, a real signal)."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from prefect_jax.training.checkpoint_dirs import committed_steps, step_dirs
from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec
from prefect_jax.training.trainer import Trainer

pytestmark = pytest.mark.slow

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent(
    """
    import sys
    from prefect_jax.training.specs import JobConfig
    from prefect_jax.training.trainer import Trainer

    trainer = Trainer(JobConfig.model_validate_json(sys.argv[1]))
    trainer.restore_or_init()
    while trainer.step < trainer.config.train.max_steps:
        trainer.train_until_checkpoint()
        print("checkpointed", trainer.step, flush=True)
    """
)


def test_a_save_that_cannot_finish_in_the_grace_period_is_abandoned(tmp_path, mlflow_uri):
    config = JobConfig(
        program="programs:big",
        job="grace",
        storage=str(tmp_path / "s"),
        train=TrainSpec(max_steps=100_000, sigterm_grace_secs=0.001),
        checkpoint=CheckpointSpec(every_steps=500),
        mlflow_tracking_uri=mlflow_uri,
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, config.model_dump_json()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=TESTS_DIR,
    )
    ckpt = os.path.join(config.storage, "grace", "checkpoints")
    deadline = time.monotonic() + 240
    while not committed_steps(ckpt):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    time.sleep(0.3)  # mid-interval
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, err[
        -3000:
    ]  # the default handler ends the process after the attempt
    assert "did not commit within 0s: abandoned" in err
    # where each thread was when the grace ran out (a commit that stalls can be told from a slow
    # one): the training thread, in the SIGTERM's handling, and the helper waiting on the commit
    stacks = err.split("each thread when the grace ran out:", 1)[-1]
    assert "thread MainThread:" in stacks and "in on_sigterm" in stacks, err[-3000:]
    assert "in wait_committed" in stacks, err[-3000:]
    newest = committed_steps(ckpt)[-1]
    at = int(re.search(r"SIGTERM at step (\d+): checkpointing it", err).group(1))
    # The abandoned save counts only if Orbax committed it whole before the process ended (its
    # commit goes on in the background while the attempt ends: on a loaded machine it can win).
    assert newest % 500 == 0 or newest == at, (newest, at)
    if newest != at:  # still written when the process was killed: the lease says so
        with open(os.path.join(config.storage, "grace", "lease.json")) as f:
            assert json.load(f)["finishing"] == f"step {at}"

    trainer = Trainer(
        config
    )  # the next run restores the newest valid step, whatever was left behind
    assert trainer.restore_or_init() == newest
    assert step_dirs(ckpt) == committed_steps(ckpt)
    trainer.close()
