"""One of two JAX processes for `test_multiprocess.py`'s peer-watch test (no Prefect, no training).

    python peer_watch.py INDEX PORT MODE

Both join (`cluster.initialize`) and meet at a barrier; then process 0 prints ``waiting`` and waits
at a barrier of JAX's coordination service through `cluster.wait_unless_lost`. MODE ``kill``:
process 1 sleeps until the test SIGKILLs it, and process 0 prints how its wait ended. MODE
``finish``: process 1 says it finished (`mark_finished`), reaches the barrier and exits at once;
process 0's wait ends, and it prints whether it took process 1 for lost.
"""

import os
import sys
import time

from prefect_jax.training import cluster

index, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
cluster.initialize(cluster.ClusterConfig(num_processes=2, process_id=index, coordinator_address=f"127.0.0.1:{port}", source="test"))

from jax._src import distributed  # noqa: E402

client = distributed.global_state.client
client.wait_at_barrier("joined", 60_000)
if index == 1:
    if mode == "kill":
        print("sleeping", flush=True)
        time.sleep(600)
    cluster.mark_finished()
    client.wait_at_barrier("end", 60_000)
    os._exit(0)  # at once, without JAX's shutdown barrier (which would wait for process 0's exit)

print("waiting", flush=True)
started = time.monotonic()
try:
    cluster.wait_unless_lost(lambda: client.wait_at_barrier("end", 120_000), "process 1 at the barrier")
    print(f"wait ended after {time.monotonic() - started:.1f}s", flush=True)
    time.sleep(1.5)  # process 1 exits meanwhile, with its goodbye said
    print(f"gone: {cluster.peer_gone()}", flush=True)
    os._exit(0)
except cluster.LostProcess as exc:
    print(f"lost after {time.monotonic() - started:.1f}s: {exc}", flush=True)
    cluster.exit_code = 3  # at exit, without waiting for JAX's shutdown or its abort
    sys.exit(3)
