"""What taking a lease does when its read-back finds another record
(`prefect_jax.training.lease_takeover`): the beat of a live holder that lands over the write, a
holder preempted in the meantime, a stale holder that proves alive. The holders' writes here are
made plainly, past the lease's compare-and-set (`lease_file`): as on storage that has none."""

import json
import logging
import os
import socket
import threading
import time

import pytest
from lease_helpers import lease_under

from prefect_jax.training.errors import LeaseHeldError, LeaseLostError
from prefect_jax.training.lease_finishing import release_after
from prefect_jax.training.storage import JobStorage


def _storage_that_after_the_takers_write(then):
    """A `JobStorage` whose first write of the lease is followed by `then()` (what the holder
    does in the window between the taker's write and its read-back)."""

    class AfterTheTakersWrite(JobStorage):
        done = False

        def write_json(self, path, obj, durable=True):
            super().write_json(path, obj, durable)
            if path.endswith("lease.json") and not AfterTheTakersWrite.done:
                AfterTheTakersWrite.done = True
                then()

    return AfterTheTakersWrite


def test_a_takeover_that_the_live_holders_heartbeat_writes_over_writes_again(tmp_path):
    """A holder taken over while alive (here: left by this process; a rerun of its own flow run on
    another host alike) can land one heartbeat, read before the takeover's write, over it. The
    takeover writes again (the holder's next beat reads it and lets go), rather than fail the
    rerun with LeaseHeldError. Seen in CI: a holder still finishing after the lease's timeout."""
    holder = lease_under(tmp_path)
    holder.acquire()
    holders_beat = holder.read()
    storage = _storage_that_after_the_takers_write(
        lambda: JobStorage.write_json(holder.storage, holder.path, holders_beat)
    )
    rerun = lease_under(tmp_path, storage_class=storage)
    try:
        rerun.acquire()
        assert storage.done and rerun.held and rerun.read()["token"] == rerun.token
        with pytest.raises(LeaseLostError):
            holder.verify()
    finally:
        rerun.release()
        holder.release()


def test_a_holder_preempted_during_the_takeover_is_waited_for_while_its_save_writes(
    tmp_path, caplog
):
    """The holder marks itself finishing (a SIGTERM's save still writes) after the taker judged
    the lease and before its write: the write, made only over the record judged, is refused
    (`lease_file`), and the lease is judged again, so the taker waits for those writes instead
    of writing over the mark and moving the half-written step aside."""
    holder = lease_under(tmp_path)
    holder.acquire()
    writes_ended = threading.Event()
    rerun = lease_under(tmp_path)
    takers_write = rerun.file.write_if

    def preempted_first(*args, **kwargs):
        if not writes_ended.is_set() and holder.finishing is None:
            release_after(holder, lambda: writes_ended.wait(30), "step 120")
            threading.Timer(1.5, writes_ended.set).start()
        return takers_write(*args, **kwargs)

    rerun.file.write_if = preempted_first
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="prefect_jax.lease"):
        rerun.acquire()
    try:
        assert rerun.held and time.monotonic() - started >= 1.4
        assert holder.read()["token"] == rerun.token  # (taken once the holder let go)
        assert rerun.taken_over is None and "may still be writing step 120" in caplog.text
    finally:
        writes_ended.set()
        rerun.release()


def test_a_holder_that_marks_itself_finishing_after_the_takeover_finds_the_job_taken(tmp_path):
    """The other order: the taker's write lands first. The holder's mark, written only over its
    own record, is refused: it finds the job taken and stops before its next checkpoint (its
    abandoned save is the taker's to move aside), never writing over the taker's record."""
    holder = lease_under(tmp_path)
    holder.acquire()
    rerun = lease_under(tmp_path)
    rerun.acquire()
    try:
        release_after(holder, lambda: None, "step 120")
        assert holder.read()["token"] == rerun.token and holder.lost_to["token"] == rerun.token
        with pytest.raises(LeaseLostError):
            holder.verify()
    finally:
        rerun.release()


def test_a_stale_holder_whose_heartbeat_lands_during_the_takeover_keeps_the_job(tmp_path):
    """A lease of another flow run taken over as stale, whose holder's beat (late: the holder was
    alive) lands over the taker's write: the holder is live again and keeps the job; the taker
    fails naming it, as it would had it read that beat first."""
    holder = {
        "token": "old",
        "flow_run_id": "run-1",
        "host": f"not-{socket.gethostname()}",
        "pid": 1,
        "timeout_secs": 60,
    }
    path = lease_under(tmp_path).path
    with open(path, "w") as f:
        json.dump(dict(holder, heartbeat=time.time() - 500), f)

    def beats():
        with open(path, "w") as f:
            json.dump(dict(holder, heartbeat=time.time()), f)

    rerun = lease_under(tmp_path, storage_class=_storage_that_after_the_takers_write(beats))
    with pytest.raises(LeaseHeldError, match="flow_run_id=run-1"):
        rerun.acquire()
    assert not rerun.held and json.load(open(path))["token"] == "old"


def test_a_holder_that_lets_go_during_the_takeover_leaves_the_job_taken_not_taken_over(tmp_path):
    """The holder's release reads the lease, then deletes it: a delete that lands after the
    taker's write. The taker writes again and holds the job, and the holder, which ended cleanly,
    is not named as taken over (its task runs would be marked crashed)."""
    holder = lease_under(tmp_path)
    holder.acquire()
    storage = _storage_that_after_the_takers_write(lambda: os.remove(holder.path))
    rerun = lease_under(tmp_path, storage_class=storage)
    try:
        rerun.acquire()
        assert storage.done and rerun.held and rerun.read()["token"] == rerun.token
        assert rerun.taken_over is None
    finally:
        rerun.release()
        holder.release()


def test_a_finishing_holder_waited_out_whose_beat_lands_before_the_write_is_not_waited_out_again(
    tmp_path, monkeypatch, caplog
):
    """A holder that marked itself finishing and keeps beating (its save stalls in a process that
    lives on) is waited for a lease timeout at most, then taken over. A beat of that holder
    between the judgement and the taker's write changes the record read only by its heartbeat:
    the taker writes over it (`lease_takeover.same_holder_beat`) rather than judge it again, which
    would wait out the same finishing holder a second time (a second lease timeout)."""
    from prefect_jax.training import lease as lease_module

    # (5 s, not 2: the holder's heartbeat thread beats every timeout/4, and a 2-core CI machine
    # under load once left it 2 s without a beat, so the holder looked gone, not finishing)
    holder = lease_under(tmp_path, timeout=5.0)
    holder.acquire()
    writes_end = threading.Event()
    release_after(holder, lambda: writes_end.wait(60), "step 120")  # (its save never ends)
    holders_token = holder.token  # (its heartbeat thread clears it once it sees the takeover)
    waited = lease_module.wait_while_finishing
    beats = []

    def then_the_holder_beats(lease, current):
        judged = waited(lease, current)
        if not beats:  # (one beat, between the judgement and the taker's read before its write)
            beats.append(holder.write_beat())
        return judged

    monkeypatch.setattr(lease_module, "wait_while_finishing", then_the_holder_beats)
    rerun = lease_under(tmp_path, timeout=5.0)
    try:
        with caplog.at_level(logging.WARNING, logger="prefect_jax.lease"):
            rerun.acquire()
        assert beats == [True] and rerun.held and rerun.read()["token"] == rerun.token
        assert rerun.taken_over["token"] == holders_token
        assert caplog.text.count("may still be writing step 120") == 1, caplog.text
        assert caplog.text.count("not waiting longer") == 1, caplog.text
    finally:
        writes_end.set()
        rerun.release()
