"""One writer per job: the lease (`prefect_jax.training.lease`) kept by its live holder, taken
over from a dead or stale one, handed back to a retry of the same flow run, torn or lost; and
storage that vanishes under a trainer. A lease kept while a preempted save still writes is in
test_lease_finishing; damaged checkpoints are in test_damaged_checkpoints."""

import json
import logging
import os
import re
import socket
import time

import pytest
from lease_helpers import lease_under

from prefect_jax.training.checkpoint_dirs import committed_steps
from prefect_jax.training.errors import LeaseHeldError, LeaseLostError
from prefect_jax.training.lease_file import LeaseFile
from prefect_jax.training.storage import JobStorage
from prefect_jax.training.trainer import Trainer


def _ckpt_dir(config):
    return os.path.join(config.storage, config.job, "checkpoints")


def _write_lease(config, **fields):
    path = os.path.join(config.storage, config.job, "lease.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lease = {
        "token": "other",
        "flow_run_id": "run-1",
        "host": socket.gethostname(),
        "pid": os.getppid(),
        "heartbeat": time.time(),
        "timeout_secs": 120,
    }
    lease.update(fields)
    # at once, as a trainer writes it: a heartbeat that read it half-written would find it torn
    # and write its own again; and under the lock every local writer takes, or a beat that
    # compared before this write would land its own record after it
    with LeaseFile(JobStorage(config.storage, config.job), path)._locked(False):
        with open(f"{path}.tmp", "w") as f:
            json.dump(lease, f)
        os.replace(f"{path}.tmp", path)
    return path


def test_a_live_owner_keeps_the_job_and_is_named(job_config):
    config = job_config()
    path = _write_lease(config, heartbeat=time.time() - 45)
    with pytest.raises(
        LeaseHeldError,
        match=rf"flow_run_id=run-1, host={socket.gethostname()}, pid={os.getppid()}; "
        r"heartbeat (4[5-9]|[5-9]\d|1[01]\d)s ago",  # (45 s, plus this test's own time up to it)
    ) as refused:
        Trainer(config).restore_or_init()
    # when a rerun elsewhere takes it, if its holder is gone (a SIGKILLed trainer's other host)
    assert re.search(
        r"older than 120s \(in ([0-6]?\d|7[0-5])s: run this again then\)", str(refused.value)
    )
    assert json.load(open(path))["token"] == "other"  # untouched


def test_a_stale_heartbeat_is_taken_over(job_config, caplog):
    config = job_config()
    path = _write_lease(config, host="another-host", heartbeat=time.time() - 500)
    trainer = Trainer(config)
    with caplog.at_level(logging.WARNING):
        trainer.restore_or_init()
    assert re.search(r"taking over the lease .*heartbeat 5[0-4]\ds old", caplog.text)
    assert json.load(open(path))["pid"] == os.getpid()
    trainer.finish()
    assert not os.path.exists(path)  # released at the end


def test_a_dead_process_on_this_host_is_taken_over_at_once(job_config):
    config = job_config()
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    _write_lease(config, pid=int(dead.stdout))
    trainer = Trainer(config)
    assert trainer.restore_or_init() == 0
    assert trainer.job.lease.held


def test_the_same_flow_run_retried_takes_its_own_lease_back(job_config):
    config = job_config()
    _write_lease(config, flow_run_id="run-7", host="another-host")
    trainer = Trainer(config, run_tags={"prefect.flow_run_id": "run-7"})
    assert trainer.restore_or_init() == 0


def test_a_second_process_of_the_same_flow_run_waits_for_the_first_to_end(job_config, caplog):
    """Prefect's process worker reports one crash twice, so a rerun automation can start a flow
    run twice: the second process waits while the first (alive, on this host) trains, then takes
    over from where it stopped, so that one process writes the job."""
    import subprocess
    import sys
    import threading

    config = job_config()
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    path = _write_lease(config, flow_run_id="run-7", pid=first.pid)
    seen = {}

    def end_the_first():
        time.sleep(2.0)
        seen["lease while it lived"] = json.load(open(path))["token"]
        first.kill()
        first.wait()

    trainer = Trainer(config, run_tags={"prefect.flow_run_id": "run-7"})
    started = time.monotonic()  # (before the thread that ends it 2 s later starts)
    threading.Thread(target=end_the_first, daemon=True).start()
    try:
        with caplog.at_level(logging.WARNING):
            assert trainer.restore_or_init() == 0
        waited = time.monotonic() - started
        assert waited >= 2.0, (
            f"took the lease of a live process of its own flow run after {waited:.1f}s"
        )
        assert seen["lease while it lived"] == "other"  # untouched while the first lived
        assert (
            f"already trains job {config.storage}/{config.job} in process {first.pid}"
            in caplog.text
        )
        assert trainer.job.lease.taken_over["reason"] == f"process {first.pid} on this host is gone"
        assert json.load(open(path))["pid"] == os.getpid()
        # Its attempt starts when it took the job: its wait overlapped the first process's training.
        assert trainer.job.goodput.attempt["seconds"]["startup"] < 0.5
        assert trainer.job.goodput.attempt["waited_for_another_process"] is True
        trainer.train_until_checkpoint()
        assert trainer.step == 20
    finally:
        first.kill()
        trainer.close()


_LEASE_IN_A_FLOW_RUN = """
import json, os, subprocess, sys, threading, time
from prefect_jax.tasks import take_the_lease_before_jax, task_trainer, trainer_holding_the_lease
from prefect_jax.training.specs import JobConfig

storage, out = sys.argv[1], {}
config = JobConfig(program="prefect_jax.examples.digits:tiny", job="tiny", storage=storage,
                   train={"max_steps": 40}, mlflow_tracking_uri=f"sqlite:///{storage}/mlflow.db")
lease_file = os.path.join(storage, "tiny", "lease.json")
first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
os.makedirs(os.path.dirname(lease_file))
with open(lease_file, "w") as f:
    json.dump({"token": "other", "flow_run_id": os.environ["PREFECT__FLOW_RUN_ID"],
               "host": os.uname().nodename, "pid": first.pid, "heartbeat": time.time(),
               "timeout_secs": 120}, f)
threading.Timer(1.5, first.kill).start()
started = time.monotonic()
lease = take_the_lease_before_jax(config)
out.update(waited=time.monotonic() - started,
           jax=[m for m in ("jax", "jaxlib") if m in sys.modules],
           holder=json.load(open(lease_file))["pid"], me=os.getpid())
trainer = task_trainer(config)
out["adopted"] = trainer.job.lease is lease
out["step"] = trainer.restore_or_init()
out["taken_over"] = trainer.job.lease.taken_over["reason"]
trainer.train_until_checkpoint()
trainer.finish()
trainer.close()
out["released"] = not os.path.exists(lease_file)

bad = config.model_copy(
    update={"job": "bad", "program": "prefect_jax.examples.digits:no_such_program"}
)
try:
    trainer_holding_the_lease(bad)
except Exception as exc:
    out["bad"] = type(exc).__name__
out["bad_released"] = not os.path.exists(os.path.join(storage, "bad", "lease.json"))
print(json.dumps(out))
"""


def test_the_restore_task_takes_the_lease_before_it_starts_jax(tmp_path):
    """In a flow run the lease is taken before JAX starts: a second process of the same flow run
    (Prefect started it twice) waits before its own JAX start, which on a GPU would take the
    device memory the first needs, whether it comes while the first trains or while it is still
    starting up. Here a live process of the same run holds the job: the restore task's process
    waits for it without starting JAX, takes the lease, and its trainer adopts that lease; a
    trainer that cannot be made gives back a lease so taken."""
    import subprocess
    import sys

    env = dict(os.environ, PREFECT__FLOW_RUN_ID="2f0e2a3c-0000-4000-8000-000000000007")
    proc = subprocess.run(
        [sys.executable, "-c", _LEASE_IN_A_FLOW_RUN, str(tmp_path / "storage")],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["waited"] >= 1.4 and out["jax"] == [], out
    assert "already trains job" in proc.stderr
    assert out["holder"] == out["me"], out  # held before JAX started
    assert out["adopted"] is True and out["step"] == 0, out
    assert out["taken_over"].endswith("on this host is gone"), out
    assert out["released"] is True, out
    assert out["bad"] is not None and out["bad_released"] is True, out


_START = """
import json, os, sys, time
from prefect_jax.tasks import take_the_lease_before_jax
from prefect_jax.training.specs import JobConfig

config = JobConfig(program="prefect_jax.examples.digits:tiny", job="tiny", storage=sys.argv[1],
                   train={"max_steps": 40})
started = time.monotonic()
take_the_lease_before_jax(config)
print(json.dumps({"waited": time.monotonic() - started, "jax": "jax" in sys.modules}), flush=True)
# The first: as if starting JAX, until told to end (SIGKILLed, say: it does not release).
if len(sys.argv) > 2:
    deadline = time.monotonic() + 120
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def test_a_second_start_of_a_flow_run_during_the_firsts_start_up_waits_before_jax(
    job_config, tmp_path
):
    """The double start Prefect makes of one rerun: the second process comes while the first is
    still starting up (the dead attempt's lease is on the job). The first takes the lease, and the
    second waits for it, not starting JAX, until the first is gone."""
    import subprocess
    import sys

    config = job_config()
    _write_lease(
        config, flow_run_id="2f0e2a3c-0000-4000-8000-000000000007", pid=2**22 + 1
    )  # the SIGKILLed attempt
    env = dict(os.environ, PREFECT__FLOW_RUN_ID="2f0e2a3c-0000-4000-8000-000000000007")
    args, end_first = (
        [sys.executable, "-c", _START, config.storage],
        str(tmp_path / "end-the-first"),
    )
    first = subprocess.Popen(
        args + [end_first], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    second = None
    try:
        took = json.loads(first.stdout.readline() or "{}")  # the first holds the job now
        assert took.get("jax") is False and took["waited"] < 1.0, (
            took,
            first.stderr.read() if first.poll() else "",
        )
        second = subprocess.Popen(
            args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        seen = ""
        while "already trains job" not in seen:  # it waits for the first (or it ended: EOF)
            line = second.stderr.readline()
            if not line:
                break
            seen += line
        assert f"already trains job {config.storage}/{config.job} in process {first.pid}" in seen, (
            seen[-3000:]
        )
        time.sleep(1.0)
        assert second.poll() is None  # still waiting while the first lives
        open(end_first, "w").close()
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err[-3000:]
        out = json.loads(out.strip().splitlines()[-1])
        assert out["jax"] is False and out["waited"] >= 1.0, out
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_an_early_lease_is_adopted_only_for_its_own_flow_run(job_config):
    from prefect_jax.training.lease_early import adopt_early, release_early, take_early
    from prefect_jax.training.storage import JobStorage

    config = job_config()
    storage = JobStorage(config.storage, config.job)
    lease = take_early(storage, "run-7", 120.0)
    try:
        assert adopt_early(storage.job_dir, "run-8") is None  # another run's trainer: not its lease
        assert (
            adopt_early(storage.job_dir, "run-7") is lease
            and adopt_early(storage.job_dir, "run-7") is None
        )  # once
    finally:
        release_early(storage.job_dir, lease)
    assert not lease.held and not os.path.exists(lease.path)


def test_a_trainer_whose_job_was_taken_over_stops_before_its_next_checkpoint(job_config):
    """Fencing: a trainer whose lease another took over (its heartbeat went stale, or a rerun of
    its flow run started elsewhere) writes no further checkpoint and leaves the lease alone."""
    from prefect_jax.training.live import finish_live, get_trainer

    config = job_config(lease_timeout_secs=2.0)
    trainer = get_trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.job.wait_committed()
    assert committed_steps(_ckpt_dir(config)) == [20]
    path = _write_lease(
        config, token="new-holder", flow_run_id="run-9", host="another-host", pid=4242
    )
    with pytest.raises(
        LeaseLostError,
        match=r"another trainer took it over \(flow_run_id=run-9, host=another-host, pid=4242\)",
    ):
        trainer.train_until_checkpoint()
    trainer.job.wait_committed()
    assert committed_steps(_ckpt_dir(config)) == [20]
    assert [
        n for n in os.listdir(_ckpt_dir(config)) if n != "20"
    ] == []  # no step 40, not even a temporary one
    assert not trainer.job.lease.held
    assert (
        finish_live(config, "FAILED") is False
    )  # the failure hook leaves the job (and its MLflow run) to its holder
    with pytest.raises(LeaseLostError):  # nor does it take the lease back
        trainer.train_until_checkpoint()
    trainer.close()
    assert json.load(open(path))["token"] == "new-holder"


def test_the_heartbeat_notices_a_takeover(job_config):
    config = job_config(lease_timeout_secs=2.0)  # a beat every 0.5 s
    trainer = Trainer(config)
    trainer.restore_or_init()
    deadline = time.monotonic() + 10
    while trainer.job.lease.held and time.monotonic() < deadline:
        _write_lease(config, token="new-holder", flow_run_id="run-9", host="another-host")
        time.sleep(0.1)
    trainer.job.lease._thread.join(10)  # (the beat that saw it ends once `_lose` and on_lost ran)
    assert trainer.job.lease.lost_to["token"] == "new-holder" and not trainer.job.lease.held
    ledger = os.path.join(config.storage, config.job, "goodput.json")
    before = open(ledger).read()
    with pytest.raises(LeaseLostError):
        trainer.train_until_checkpoint()
    with pytest.raises(LeaseLostError):  # nor is the job this process's to call finished
        trainer.finish()
    trainer.job.goodput.end("failed")
    assert not trainer.job.tracker.enabled  # the MLflow run is the new holder's
    trainer.close()
    assert open(ledger).read() == before  # nor its goodput ledger


def test_heartbeat_keeps_the_lease_fresh(job_config):
    config = job_config()
    config = config.model_copy(
        update={"train": config.train.model_copy(update={"lease_timeout_secs": 2.0})}
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    path = os.path.join(config.storage, config.job, "lease.json")
    first = json.load(open(path))["heartbeat"]
    deadline = time.monotonic() + 10  # (a beat every 0.5 s; a loaded machine may delay some)
    while json.load(open(path))["heartbeat"] == first and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.load(open(path))["heartbeat"] > first
    trainer.close()
    assert not os.path.exists(path)


def test_a_retry_that_takes_its_job_back_marks_only_the_dead_attempts_task_runs_crashed(
    prefect_server,
):
    """The retry's restore task marks the killed attempt's unfinished task runs Crashed, in the
    background; the retry's own next task run may exist by then, Pending with no attempt number
    yet (found so in a suite run: its `evaluate` was marked Crashed after it completed). Real
    task runs on a real Prefect server: the one made before the restore task is marked, the one
    made after it is not."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.states import Pending, Running

    from prefect_jax.tasks.runs import _mark_crashed

    @task
    def step():
        pass

    @flow
    def job():
        pass

    from prefect._internal.uuid7 import uuid7  # how Prefect's task engine makes task run ids

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(job, state=Running())
        dead = client.create_task_run(
            step, run.id, "dead", id=uuid7(), state=Running()
        )  # the killed attempt's
        restore = client.create_task_run(
            step, run.id, "restore", id=uuid7(), state=Running()
        )  # the retry's
        after = client.create_task_run(
            step, run.id, "next", id=uuid7(), state=Pending()
        )  # the retry's next, no attempt number yet
        assert after.flow_run_run_count == dead.flow_run_run_count == 0

        @flow
        def takeover():
            _mark_crashed(
                {"flow_run_id": str(run.id), "host": "h", "pid": 1, "reason": "a test"},
                str(run.id),
                2,
                str(restore.id),
            )

        takeover()
        assert client.read_task_run(dead.id).state.is_crashed()
        assert client.read_task_run(after.id).state.is_pending()
        assert client.read_task_run(restore.id).state.is_running()


def test_a_process_that_loses_the_lease_to_a_live_process_of_its_own_flow_run_waits_for_it(
    job_config, caplog, monkeypatch
):
    """Seen in a suite run (a flow run started twice by the automation, on 2 loaded CPUs): the
    first process's heartbeat came late, so its lease looked stale; the second took it over and
    the first's late beat landed over that write. The second waits for the first, as for any
    live process of its own flow run, instead of failing the flow run with LeaseHeldError."""
    import subprocess
    import sys
    import threading

    from prefect_jax.training.lease import Lease
    from prefect_jax.training.storage import JobStorage

    config = job_config()
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    path = _write_lease(
        config, flow_run_id="run-8", pid=first.pid, heartbeat=time.time() - 600
    )  # looks stale
    storage = JobStorage(config.storage, config.job)
    write_json, beats = JobStorage.write_json, []

    def with_a_late_beat(self, target, obj, *args, **kwargs):
        write_json(self, target, obj, *args, **kwargs)
        if target == path and not beats:  # the first's beat, read before this write, lands after it
            beats.append(dict(obj, token="other", pid=first.pid, heartbeat=time.time()))
            write_json(self, target, beats[0])
            threading.Timer(
                1.5, lambda: (os.remove(path), first.kill(), first.wait())
            ).start()  # it ends, releasing

    monkeypatch.setattr(JobStorage, "write_json", with_a_late_beat)
    lease = Lease(storage, owner_id="run-8", timeout_secs=120)
    try:
        with caplog.at_level(logging.WARNING):
            lease.acquire()
        assert lease.held and first.poll() is not None  # taken once the first had ended
        assert (
            f"already trains job {config.storage}/{config.job} in process {first.pid}"
            in caplog.text
        )
        assert json.load(open(path))["token"] == lease.token
        assert (
            lease.taken_over is None
        )  # released, not taken over: its task runs are not marked crashed
    finally:
        lease.release()
        first.kill()


def test_a_restore_that_lost_the_lease_to_a_live_process_of_its_own_flow_run_waits_for_it(
    job_config, caplog
):
    """Seen in a suite run (a flow run started three times on a process worker, 2 loaded CPUs):
    two waiting processes took the lease as the first freed it, each read its own write back,
    and the later write won; the other found the lease gone at its restore and failed the flow
    run they share with LeaseLostError after the winner had completed it. A restore that lost the
    lease to a live process of its own flow run waits for that process, then resumes after it
    from the newest commit, with its records (MLflow, goodput) written again."""
    import subprocess
    import sys
    import threading

    config = job_config()
    trainer = Trainer(config, run_tags={"prefect.flow_run_id": "run-9"})
    trainer.job.acquire_lease()  # (as a flow takes it, before its restore task)
    assert trainer.job.lease.held
    winner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    path = _write_lease(config, flow_run_id="run-9", pid=winner.pid)  # its later write won

    def the_winner_ends():
        time.sleep(2.0)
        os.remove(path)  # (its release)
        winner.kill()
        winner.wait()

    started = time.monotonic()  # (as above)
    threading.Thread(target=the_winner_ends, daemon=True).start()
    try:
        with caplog.at_level(logging.WARNING):
            assert trainer.restore_or_init() == 0
        assert time.monotonic() - started >= 2.0, "restored while the winner trained"
        assert "to another process of this flow run: waiting for it" in caplog.text
        assert json.load(open(path))["token"] == trainer.job.lease.token
        assert trainer.job.tracker.enabled and trainer.job.goodput.enabled
        trainer.train_until_checkpoint()
        assert trainer.step == 20
    finally:
        trainer.close()
        winner.kill()


def test_a_job_directory_that_vanishes_and_comes_back_is_named_and_nothing_lands_in_it(
    job_config, tmp_path
):
    """Issue 53.4: storage that disappears mid-run (here: the job's directory moved away, an
    empty one made in its place, as a remount of an empty volume) is said as such, not as a
    takeover by another trainer, and nothing more is written into the directory now there."""
    from prefect_jax.training.lease import JobDirectoryGoneError

    config = job_config(lease_timeout_secs=60.0)
    job_dir = os.path.join(config.storage, config.job)
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.job.wait_committed()
    away = str(tmp_path / "away")
    os.rename(job_dir, away)
    os.makedirs(job_dir)
    with pytest.raises(JobDirectoryGoneError, match="disappeared and is another directory now"):
        trainer.train_until_checkpoint()
    with pytest.raises(LeaseLostError):  # (one: the flow's handling of a lost lease holds)
        trainer.finish()
    trainer.close()
    assert os.listdir(job_dir) == [], "nothing written into the directory that is there now"
    os.rmdir(job_dir)
    os.rename(away, job_dir)  # the storage is back: the rerun resumes from its committed step
    rerun = Trainer(config)
    assert rerun.restore_or_init() == 20
    rerun.train_until_checkpoint()
    rerun.finish()
    rerun.close()
    assert committed_steps(_ckpt_dir(config))[-1] == 40


def test_a_torn_lease_keeps_the_job_until_it_goes_stale_by_its_last_write(tmp_path, caplog):
    """A torn lease file (a write cut short) is held by a trainer nobody can name, not by none:
    read as absent, it let a second trainer take a live job silently."""
    lease = lease_under(tmp_path, timeout=60.0)
    with open(lease.path, "w") as f:
        f.write('{"token": "other", "flow_run_id": "run-1", "ho')
    with pytest.raises(LeaseHeldError, match=r"unknown: its lease file .*lease\.json is torn"):
        lease.acquire()
    assert not lease.held and open(lease.path).read().endswith('"ho')  # untouched
    old = time.time() - 500  # its last write older than the timeout: stale, as any lease
    os.utime(lease.path, (old, old))
    with caplog.at_level(logging.WARNING, logger="prefect_jax.lease"):
        lease.acquire()
    try:
        assert lease.held and json.load(open(lease.path))["token"] == lease.token
        assert re.search(
            r"taking over .*lease file is torn and was last written 50\ds ago", caplog.text
        )
    finally:
        lease.release()


def test_a_live_holder_whose_lease_is_torn_writes_it_again_and_trains_on(tmp_path, caplog):
    """The holder's own lease torn under it (bit rot): it cannot have been taken over (its
    heartbeats kept it fresh), so the holder writes it again rather than stopping as if another
    trainer had taken the job, and the file says who holds it again."""
    lease = lease_under(tmp_path, timeout=2.0)
    lease.acquire()
    try:
        with open(lease.path, "w") as f:
            f.write('{"token": "' + lease.token[:5])
        with caplog.at_level(logging.WARNING, logger="prefect_jax.lease"):
            lease.verify()  # a checkpoint's check: repaired, not lost
            time.sleep(1.5)  # three heartbeats
        assert lease.held and lease.lost_to is None
        assert json.load(open(lease.path))["token"] == lease.token
        assert "lease.json is torn; this trainer holds the lease and writes it again" in caplog.text
    finally:
        lease.release()


def test_the_heartbeat_never_makes_a_vanished_job_directory_again(tmp_path):
    """The job's directory vanishing between the heartbeat's read and its write: the write must
    not make it again (the next read would find the lease in place and the vanish papered over)."""
    import shutil
    import threading

    from prefect_jax.training.lease import JobDirectoryGoneError
    from prefect_jax.training.storage import JobStorage

    away = tmp_path / "away"

    class VanishingAfterARead(JobStorage):
        """Storage that disappears just after the heartbeat's first read (the fault, timed)."""

        def read_json(self, path):
            out = super().read_json(path)
            if threading.current_thread().name == "prefect-jax-lease" and not away.exists():
                shutil.move(self.job_dir, away)
            return out

    lease = lease_under(tmp_path, timeout=2.0, storage_class=VanishingAfterARead)
    lease.acquire()
    job_dir = lease.storage.job_dir
    deadline = time.monotonic() + 30
    while lease.held and time.monotonic() < deadline:
        time.sleep(0.1)
    assert away.exists() and not os.path.exists(job_dir), os.listdir(job_dir)
    with pytest.raises(JobDirectoryGoneError, match=r"the job's directory .* is gone"):
        lease.verify()


def test_a_release_whose_lease_file_another_writer_removed_after_its_read_still_ends(tmp_path):
    """A late beat of a holder that lost the job lands over the new holder's lease and frees it
    between the new holder's read and its remove (two leases of one flow run, CI): the release
    still ends, the job free, and raises nothing into the `finally` that called it."""
    import threading

    from prefect_jax.training.storage import JobStorage

    class FreedAfterARead(JobStorage):
        """Storage whose lease file goes just after the release's read (the race, timed)."""

        def read_json(self, path):
            out = super().read_json(path)
            if threading.current_thread().name != "prefect-jax-lease" and releasing.is_set():
                os.remove(path)
            return out

    releasing = threading.Event()
    lease = lease_under(tmp_path, timeout=60.0, storage_class=FreedAfterARead)
    lease.acquire()
    releasing.set()
    lease.release()
    assert not lease.held and not os.path.exists(lease.path)


def test_a_second_flow_run_of_a_job_in_this_process_leaves_the_first_ones_trainer_alone(
    job_config,
):
    """A sweep's two trials given one job name, on a threaded task runner: the second's trainer
    (other params) closed the first's live trainer as it trained, and each took the other's
    lease ("left by this process"). Now the second is refused, naming the first flow run, and
    the first trains on; once that run has ended (its lease let go), the job is the next one's."""
    from prefect_jax.training import live
    from prefect_jax.training.errors import JobTrainedHereError
    from prefect_jax.training.names import FLOW_RUN_ID_TAG

    first_config = job_config(job="trial")
    other = first_config.model_copy(
        update={"train": first_config.train.model_copy(update={"seed": 7})}
    )
    first = live.get_trainer(first_config, run_tags={FLOW_RUN_ID_TAG: "run-a"})
    try:
        first.restore_or_init()
        with pytest.raises(JobTrainedHereError, match=r"in this process by flow run run-a"):
            live.get_trainer(other, run_tags={FLOW_RUN_ID_TAG: "run-b"})
        assert live.live_trainer(first_config) is first and first.job.lease.held
        first.train_until_checkpoint()  # (not closed under it)
        # Its own run's next task gets it; after its end, another run's trainer replaces it.
        assert live.get_trainer(first_config, run_tags={FLOW_RUN_ID_TAG: "run-a"}) is first
        first.finish("FINISHED")
        second = live.get_trainer(other, run_tags={FLOW_RUN_ID_TAG: "run-b"})
        assert second is not first
    finally:
        live.drop_all()


def test_status_names_who_trains_the_job_now_and_a_holder_that_is_gone(job_config):
    """An operator's first question after a `LeaseHeldError` (the platform probe's): the lease's
    holder, its heartbeat's age, and whether it is gone; nothing once no lease is held."""
    from prefect_jax.cli.status import describe_trainer
    from prefect_jax.training.job_status import job_status

    config = job_config()
    host = socket.gethostname()

    def trainer():
        return job_status(config.job, config.storage)["trainer"]

    path = _write_lease(config, heartbeat=time.time() - 45)  # (this test's parent: alive)
    live = trainer()
    assert (live["flow_run_id"], live["host"], live["pid"]) == ("run-1", host, os.getppid())
    assert live["gone"] is None and 45 <= live["heartbeat_age_secs"] < 120, live
    said = describe_trainer(live)
    assert re.fullmatch(
        rf"flow run run-1 on {host} \(pid {os.getppid()}\), heartbeat \d+s ago", said
    )

    _write_lease(config, host="another-host", heartbeat=time.time() - 500)
    stale = trainer()
    assert re.fullmatch(r"heartbeat 5\d\ds old", stale["gone"]), stale
    assert describe_trainer(stale).startswith("none: flow run run-1 on another-host (pid ")
    assert "the next trainer takes it over" in describe_trainer(stale)

    os.remove(path)
    assert trainer() is None
    assert describe_trainer(None) == "none (no trainer holds the job's lease)"
