"""A lease kept past its attempt's end while the attempt's last save may still be written
(`prefect_jax.training.lease_finishing`): a rerun waits for the writes to end, but not for a
holder that is gone, nor for longer than the lease's timeout. The rest of the lease is in
test_lease; a real process killed mid-save in test_sigterm_grace."""

import json
import logging
import re
import socket
import time

import pytest
from lease_helpers import lease_under


def test_a_preempted_holder_still_writing_its_step_keeps_the_job_until_the_writes_end(
    tmp_path, caplog
):
    """A save that outlives the grace period goes on writing: a rerun of the same flow run (which
    takes its own run's lease at once) waits until the holder's writes end and it lets the job
    go, rather than moving the half-written step aside under the writer."""
    import threading

    from prefect_jax.training.lease_finishing import release_after

    holder, rerun = lease_under(tmp_path), lease_under(tmp_path)  # (both of flow run "run-2")
    holder.acquire()
    writes = threading.Event()
    release_after(holder, lambda: writes.wait(30), "step 120")
    record = json.load(open(holder.path))
    assert record["finishing"] == "step 120" and record["token"] == holder.token
    holder.release()  # (the attempt's other ends: not before the writes end)
    assert holder.held and json.load(open(holder.path))["token"] == holder.token
    taken = threading.Thread(target=rerun.acquire)
    with caplog.at_level(logging.WARNING, logger="prefect_jax.lease"):
        taken.start()
        time.sleep(1.5)
        assert taken.is_alive() and not rerun.held  # waiting
        writes.set()
        taken.join(timeout=10)
    try:
        assert rerun.held and json.load(open(rerun.path))["token"] == rerun.token
        assert "finishing" not in json.load(open(rerun.path))
        assert "may still be writing step 120" in caplog.text
        assert not holder.held and holder.finishing is None
    finally:
        rerun.release()


@pytest.mark.parametrize("gone", ["its heartbeat is stale", "its process is gone"])
def test_a_finishing_holder_whose_process_is_gone_is_not_waited_for(tmp_path, gone):
    """A process that ended stopped writing: its lease, still marked finishing, is taken over
    as any lease of its own flow run."""
    import subprocess
    import sys

    lease = lease_under(tmp_path)
    record = {"token": "old", "flow_run_id": "run-2", "finishing": "step 120"}
    if gone == "its heartbeat is stale":
        record.update(host="another-host", pid=1, heartbeat=time.time() - 500)
    else:
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        )
        record.update(host=socket.gethostname(), pid=int(dead.stdout), heartbeat=time.time())
    with open(lease.path, "w") as f:
        json.dump(dict(record, timeout_secs=60), f)
    started = time.monotonic()
    lease.acquire()
    try:
        assert lease.held and time.monotonic() - started < 5
    finally:
        lease.release()


def test_a_holder_finishing_for_longer_than_the_lease_timeout_is_not_waited_for_longer(
    tmp_path, caplog
):
    """A commit that stalls in a process that lives on keeps its heartbeat fresh for ever: the
    rerun waits the lease's timeout, then judges the lease as any other."""
    import threading

    from prefect_jax.training.lease_finishing import release_after

    # (5 s, not 2: the holder's heartbeat thread beats every timeout/4, and a 2-core CI machine
    # under load once left it 2 s without a beat, so the holder looked gone, not finishing)
    holder, rerun = lease_under(tmp_path, timeout=5.0), lease_under(tmp_path, timeout=5.0)
    holder.acquire()
    never = threading.Event()
    release_after(holder, lambda: never.wait(30), "step 120")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="prefect_jax.lease"):
        rerun.acquire()  # (of the same flow run: taken over once not waited for)
    try:
        assert rerun.held and 5.0 < time.monotonic() - started < 15.0
        # (5 s and the last poll's overrun: said in whole seconds)
        assert re.search(
            r"still finishing step 120 after ([5-9]|1\d)s: not waiting longer", caplog.text
        )
    finally:
        never.set()
        rerun.release()


def test_a_process_of_the_same_flow_run_that_takes_the_job_from_a_finishing_holder_is_waited_for(
    tmp_path, caplog
):
    """Two processes of one flow run on this host wait for a holder that is finishing; the first
    takes the job as the holder lets go. The second waits for that one too, as for any live
    process of its own flow run, instead of taking its own run's lease over at once."""
    import os
    import subprocess
    import sys
    import threading

    lease = lease_under(tmp_path)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    here, now = socket.gethostname(), time.time()
    with open(lease.path, "w") as f:  # (a holder of this process, finishing)
        record = {"token": "old", "flow_run_id": "run-2", "host": here, "pid": os.getpid()}
        json.dump(dict(record, heartbeat=now, timeout_secs=60, finishing="step 120"), f)

    def the_other_takes_it():
        # (written whole, by a rename, as a lease is: the acquire reads it meanwhile)
        record = {"token": "other", "flow_run_id": "run-2", "host": here, "pid": other.pid}
        with open(f"{lease.path}.tmp", "w") as f:
            json.dump(dict(record, heartbeat=time.time(), timeout_secs=60), f)
        os.replace(f"{lease.path}.tmp", lease.path)
        threading.Timer(1.5, lambda: (os.remove(lease.path), other.kill(), other.wait())).start()

    threading.Timer(1.0, the_other_takes_it).start()
    try:
        with caplog.at_level(logging.WARNING):
            lease.acquire()
        assert lease.held and other.poll() is not None  # taken once the other had ended
        assert f"in process {other.pid}" in caplog.text and lease.taken_over is None
    finally:
        lease.release()
        other.kill()
