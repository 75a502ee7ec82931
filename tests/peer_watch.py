"""Processes of one JAX job for `test_multiprocess.py`'s peer-watch test (no Prefect, no training).

    python peer_watch.py INDEX COUNT PORT MODE FLAG_FILE

All join (`cluster.initialize`) and meet at a barrier; then every process but the last prints
``waiting`` and waits at a barrier of JAX's coordination service through `cluster.wait_unless_lost`.
MODE ``kill``: the last process sleeps until the test SIGKILLs it, and the others print how their
wait ended (process 0 sees the connection close; the others hear it from process 0) and when
they exit, all but process 0 a second after that (as a process reporting its run's end). MODE
``finish``: the last process says it finished (`mark_finished`), reaches the barrier and exits at
once; the others' wait ends, and once the test made FLAG_FILE (the last process has exited) they
print whether they took it for lost.
"""

import os
import sys
import time

from prefect_jax.training import cluster, peer_watch

index, count, port, mode, flag = (
    int(sys.argv[1]),
    int(sys.argv[2]),
    sys.argv[3],
    sys.argv[4],
    sys.argv[5],
)
cluster.initialize(
    cluster.ClusterConfig(
        num_processes=count,
        process_id=index,
        coordinator_address=f"127.0.0.1:{port}",
        source="test",
    )
)

from jax._src import distributed  # noqa: E402

client = distributed.global_state.client
client.wait_at_barrier("joined", 60_000)
last = count - 1
if index == last:
    if mode == "kill":
        print("sleeping", flush=True)
        time.sleep(600)
    cluster.mark_finished()
    client.wait_at_barrier("end", 60_000)
    os._exit(0)  # at once, without JAX's shutdown barrier (which would wait for the others' exit)

print("waiting", flush=True)
try:
    cluster.wait_unless_lost(
        lambda: client.wait_at_barrier("end", 120_000), f"process {last} at the barrier"
    )
    print("wait ended", flush=True)
    while not os.path.exists(flag):
        time.sleep(0.05)
    time.sleep(0.5)
    print(f"gone: {peer_watch.peer_gone()}", flush=True)
    os._exit(0)
except peer_watch.LostProcess as exc:
    lost_after = time.monotonic() - peer_watch._gone_at
    print(f"lost {lost_after:.2f}s after the peer went away: {exc}", flush=True)
    if index:  # a real process reports its run's end first: process 0 must go after it
        time.sleep(1.0)
    print(f"exiting at {time.time():.3f}", flush=True)
    cluster.exit_code = 3  # at exit, without waiting for JAX's shutdown or its abort
    sys.exit(3)
