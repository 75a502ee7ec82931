"""A SIGTERM's delivery, however Python delivers it (issue 10's fault sweep): a handler run inside
a garbage-collector callback, whose exception Python drops, is delivered again; a notice met in
code holding a lock the trainer's ending needs still frees the lease in time; a trainer whose
notice went on to a handler that returned refuses to go on; the command ends terminated when a
SIGTERM breaks an import.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading

import pytest
from mlflow.tracking import MlflowClient
from process_helpers import TESTS_DIR, cli_env, wait_until

from prefect_jax.training.checkpoint_dirs import committed_steps
from prefect_jax.training.trainer import Trainer


@pytest.mark.slow
@pytest.mark.parametrize("where", ["start", "restore", "eval"])
def test_a_sigterm_whose_handler_runs_inside_a_gc_callback_still_ends_the_job(
    where, tmp_path, prefect_server, mlflow_uri
):
    """A SIGTERM handled inside a garbage-collector callback (JAX runs one at every collection),
    where Python drops the handler's exception: the fault sweep's lost notice. Before, the job
    trained on to its end and exited 0 (at `start`, `restore`), or, with the guard's forward
    dropped (`eval`), it evaluated and exported after closing its MLflow run KILLED and freeing its
    lease, then trained a step more. Now the signal is delivered again (~10 ms later; the trainer
    that handled it refuses to go on meanwhile): the job ends terminated, having trained nothing
    past the notice. At `eval` the trainer's work runs on the trainer thread, so the callback runs
    there and the handler in the task's wait on the main thread: nothing is dropped, and the job
    ends the same way. ``restore`` runs the flow without the command around it, as a worker's or
    `serve`'s flow run does."""
    import httpx

    storage, job = str(tmp_path / "storage"), f"gc-{where}"
    args = [
        "--program",
        "prefect_jax.examples.digits:tiny",
        "--job",
        job,
        "--storage",
        storage,
        "--max-steps",
        "60",
        "--checkpoint-every-steps",
        "20",
        "--mlflow-tracking-uri",
        mlflow_uri,
        "--no-progress",
    ]
    proc = subprocess.run(
        [sys.executable, "sigterm_in_gc_callback.py", where, *args],
        capture_output=True,
        text=True,
        env=cli_env(prefect_server),
        cwd=TESTS_DIR,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    dropped = "Exception ignored in: <function sigterm_inside_a_gc_callback" in out
    sent_again = (
        "prefect-jax: the exception of the SIGTERM handler above was dropped where it was raised: "
        "sending SIGTERM again" in out
    )
    # At `eval` the callback runs on the trainer thread: the handler runs on the main thread, in
    # the task's wait for the trainer, where nothing drops its exception.
    assert (dropped, sent_again) == ((False, False) if where == "eval" else (True, True)), out[
        -3000:
    ]
    # The command exits 128 + 15; a flow run called bare ends as Prefect
    # ends it: by the signal itself.
    assert proc.returncode == (-signal.SIGTERM if where == "restore" else 143), out[-3000:]
    assert committed_steps(os.path.join(storage, job, "checkpoints")) == (
        [20] if where == "eval" else []
    ), out[-3000:]
    assert not os.path.exists(os.path.join(storage, job, "exports")), out[-3000:]
    runs = httpx.post(
        f"{prefect_server}/flow_runs/filter",
        json={"flow_runs": {"name": {"any_": [f"train-and-evaluate-{job}"]}}},
        timeout=30,
    ).json()
    assert [r["state_type"] for r in runs] == ([] if where == "start" else ["CRASHED"]), runs
    if where == "eval":
        client = MlflowClient(mlflow_uri)
        (mlflow_run,) = client.search_runs(
            [client.get_experiment_by_name("prefect-jax").experiment_id],
            filter_string=f"tags.`prefect_jax.job` = '{storage}/{job}'",
        )
        assert mlflow_run.info.status == "KILLED"
        assert (
            "train/loss" in mlflow_run.data.metrics
        )  # (the names are these: the check below can fail)
        # The evaluation of step 20 (committed) runs on the trainer thread: where it ended before
        # the notice reached the trainer, it is recorded and logged, before the run was closed
        # KILLED (the rerun does not evaluate it again); never logged without its record, nor
        # exported (checked above).
        logged = [k for k in mlflow_run.data.metrics if k.startswith("eval/")]
        records = glob.glob(os.path.join(storage, job, "evals", "*", "*.json"))
        assert bool(logged) == bool(records), (mlflow_run.data.metrics, records)
        assert all(os.path.basename(r) == "20.json" for r in records), records


@pytest.fixture
def sigterm_handler(monkeypatch):
    """A SIGTERM handler for this test (raising `raises`, if set), a hook Python's dropped
    exceptions go to before prefect-jax's, and the module state a notice leaves reset afterwards:
    yields the list of what happened ("handler", "dropped <type>")."""
    import sigterm_in_gc_callback

    from prefect_jax.training import preemption

    calls: list[str] = []

    class Handler:
        raises: type[BaseException] | None = None

        def __call__(self, signum, frame):
            calls.append("handler")
            if self.raises is not None:
                raise self.raises(signum)

    handler = Handler()
    monkeypatch.setattr(preemption, "_received", None)
    monkeypatch.setattr(preemption, "_handler_codes", set(preemption._handler_codes))
    monkeypatch.setattr(preemption, "_sending", None)
    monkeypatch.setattr(sigterm_in_gc_callback, "_sent", [])
    monkeypatch.setattr(
        sys,
        "unraisablehook",
        lambda unraisable: calls.append(f"dropped {type(unraisable.exc_value).__name__}"),
    )
    before = signal.signal(signal.SIGTERM, handler)
    try:
        yield calls, handler
    finally:
        for (
            thread
        ) in threading.enumerate():  # a signal still to be sent again comes here, not to pytest
            if thread.name == preemption.RESEND_THREAD:
                thread.join(timeout=30)
        _wait_in_ordinary_code(0.05)
        signal.signal(signal.SIGTERM, before)


@pytest.fixture
def sends(monkeypatch):
    """The signals prefect-jax would send again (recorded, not sent)."""
    from prefect_jax.training import preemption

    sent: list[int] = []
    monkeypatch.setattr(
        preemption, "_send_when_set", lambda signum: (sent.append(signum), threading.Event())[1]
    )
    return sent


class Ended(Exception):
    pass


def _wait_in_ordinary_code(secs: float) -> None:
    import time

    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        time.sleep(0.001)


def test_a_guard_whose_forwarded_notice_python_drops_delivers_it_again(sigterm_handler):
    """The Python API (no command, no flow): the trainer's guard, handling a SIGTERM inside a gc
    callback, forwards it to the handler before it, whose exception Python drops; the signal is
    delivered again until the handler's exception reaches ordinary code."""
    from sigterm_in_gc_callback import sigterm_inside_a_gc_callback

    from prefect_jax.training import preemption

    calls, handler = sigterm_handler
    handler.raises = Ended
    guard = preemption.PreemptionGuard(lambda: (calls.append("on_signal"), guard.forward()))
    try:
        guard.install()
        with pytest.raises(Ended):
            sigterm_inside_a_gc_callback()
            _wait_in_ordinary_code(30)
    finally:
        guard.uninstall()
    # (A collection of this process's heap can outlast the first delivery again:
    # JAX's gc callback drops it then.)
    assert calls[:3] == ["on_signal", "handler", "dropped Ended"] and calls[3:] == [
        "handler",
        "dropped Ended",
    ] * ((len(calls) - 4) // 2) + ["handler"], calls
    assert preemption.received_signal() == signal.SIGTERM


def test_a_notice_dropped_while_an_earlier_one_is_handled_is_not_sent_again(sigterm_handler, sends):
    """A SIGTERM whose handler's exception is dropped is sent again, unless it was raised while an
    earlier one's was being handled (Prefect's crash handling, say): the first one ends the
    process, and a signal sent again would break into its handling."""
    import sigterm_in_gc_callback

    from prefect_jax.training import preemption

    calls, handler = sigterm_handler
    handler.raises = Ended
    preemption.deliver_lost_notices()
    sigterm_in_gc_callback.sigterm_inside_a_gc_callback()  # in ordinary code: sent again
    assert (calls, sends) == (["handler", "dropped Ended"], [signal.SIGTERM])
    sigterm_in_gc_callback._sent.clear()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_in_ordinary_code(30)
    except Ended:
        # while the first one is handled: not sent again
        sigterm_in_gc_callback.sigterm_inside_a_gc_callback()
    assert (calls[2:], sends) == (["handler", "handler", "dropped Ended"], [signal.SIGTERM])


def test_drops_before_the_signal_goes_again_send_it_once(sigterm_handler):
    """Two notices dropped before the first is sent again: one signal (a second would break into
    the handling of the first)."""
    from prefect_jax.training import preemption

    calls, _ = sigterm_handler
    first, second = (
        preemption._send_when_set(signal.SIGTERM),
        preemption._send_when_set(signal.SIGTERM),
    )
    assert first is second
    first.set()
    _wait_in_ordinary_code(1.0)
    assert calls == ["handler"]


def test_only_a_sigterm_handlers_dropped_exception_is_a_notice(monkeypatch, sends):
    """With no handler of its own in place (SIG_DFL: an IntEnum, whose class's call is Enum's), an
    exception dropped on its way out of an Enum lookup, or anything else, is no notice."""
    import enum

    from prefect_jax.training import preemption

    class Colour(enum.Enum):
        RED = 1

    class Finalised:
        def __del__(self):
            Colour(7)

    dropped: list[str] = []
    monkeypatch.setattr(
        sys,
        "unraisablehook",
        lambda unraisable: dropped.append(type(unraisable.exc_value).__name__),
    )
    monkeypatch.setattr(preemption, "_handler_codes", set(preemption._handler_codes))
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        preemption.deliver_lost_notices()
        Finalised()  # (dropped at once)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (dropped, sends) == (["ValueError"], [])


def test_a_signal_sent_again_whose_handler_runs_inside_the_hook_is_sent_again(
    sigterm_handler, monkeypatch, sends
):
    """The handler of a SIGTERM that comes while the hook itself runs (here: the hook before it
    raises the signal) raises inside the hook, where Python would drop it too, and then for good:
    the hook catches it and sends the signal again."""
    from prefect_jax.training import preemption

    calls, handler = sigterm_handler
    handler.raises = Ended

    def hook_that_takes_a_signal(unraisable):
        calls.append(f"dropped {type(unraisable.exc_value).__name__}")
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(sys, "unraisablehook", hook_that_takes_a_signal)
    preemption.deliver_lost_notices()

    class Finalised:
        def __del__(self):
            raise KeyError("no notice")

    Finalised()  # (dropped at once: the hook runs, and takes the SIGTERM)
    assert (calls, sends) == (["dropped KeyError", "handler"], [signal.SIGTERM])


def test_a_notice_whose_handling_fails_still_goes_on_to_the_handler_before(
    sigterm_handler, job_config, monkeypatch
):
    """The trainer's handling of a notice fails (storage gone with the node, say): the signal still
    goes on to the handler before the guard (Prefect's bridge ends the run), with the failure as
    its context, and the trainer refuses to go on. Before, the failure alone came out, the notice
    was never forwarded, and the guard, still handling it, took no later SIGTERM."""
    from prefect_jax.training.errors import Preempted

    calls, handler = sigterm_handler
    handler.raises = Ended
    trainer = Trainer(job_config(max_steps=40, every_steps=20))
    try:
        trainer.restore_or_init()
        trainer.train_until_checkpoint()
        gone = lambda *a: (_ for _ in ()).throw(OSError("storage went away"))  # noqa: E731
        monkeypatch.setattr(trainer.job, "committed_steps", gone)
        monkeypatch.setattr(trainer.job, "is_committed", gone)
        with pytest.raises(Ended) as ended:
            os.kill(os.getpid(), signal.SIGTERM)  # between tasks: the guard handles it at once
            _wait_in_ordinary_code(30)
        assert isinstance(ended.value.__context__, OSError) and calls == ["handler"], calls
        with pytest.raises(Preempted, match="preempted at step 20"):
            trainer.evaluate_if_new()
    finally:
        trainer.close()


def test_a_notice_inside_code_holding_a_lock_the_ending_needs_frees_the_lease_in_time(
    sigterm_handler, job_config, monkeypatch, mlflow_uri
):
    """The SIGTERM's handler runs wherever the main thread is: here inside code that holds a lock
    (as Prefect does while it sends an event between tasks) which the ending needs too (an
    evaluation's record publishes an event). The ending gives up on that record (run on a helper
    thread) at the grace period; the MLflow run closes KILLED, the lease is freed and the signal
    goes on in time. Before, the main thread waited on its own lock, and Prefect's runner, 30 s
    after a cancel's SIGTERM, killed the process with the lease still held
    (tests/test_deployment_cancel.py failed so in CI)."""
    import time

    from conftest import hold_commit

    calls, handler = sigterm_handler
    handler.raises = Ended
    grace = 2.0
    commit = hold_commit(monkeypatch, 20)
    event_queue = threading.Lock()  # (Prefect's: a plain lock, held while an event is queued)

    def publish(result):  # the evaluate task's `on_recorded`: it sends an event
        if event_queue.acquire(timeout=20):
            event_queue.release()

    trainer = Trainer(job_config(max_steps=40, every_steps=20, sigterm_grace_secs=grace))
    try:
        trainer.restore_or_init()
        trainer.train_until_checkpoint()
        assert trainer.evaluate_if_new(on_recorded=publish).pending_commit
        commit.set()  # step 20 commits; its evaluation is recorded as the attempt ends
        wait_until(lambda: 20 in trainer.committed_steps(), 60, "step 20 committed", poll=0.05)
        started = time.monotonic()
        with pytest.raises(Ended), event_queue:
            os.kill(os.getpid(), signal.SIGTERM)  # between tasks: the guard handles it at once
            _wait_in_ordinary_code(30)
        took = time.monotonic() - started
        assert not os.path.exists(os.path.join(trainer.job.storage.job_dir, "lease.json"))
        assert took < grace + 5, f"the signal went on {took:.1f}s after it came"
        assert 20 in trainer.committed_steps() and calls == ["handler"], calls
        # (closed from a helper thread, which may finish after the signal went on)
        client, run_id = MlflowClient(mlflow_uri), trainer.job.tracker.run_id
        wait_until(
            lambda: client.get_run(run_id).info.status == "KILLED", 30, "the run KILLED", poll=0.2
        )
    finally:
        trainer.close()


def test_a_trainer_whose_notice_went_on_to_a_handler_that_returned_does_nothing_more(
    sigterm_handler, job_config
):
    """The trainer checkpointed, closed its MLflow run KILLED and freed its lease on a SIGTERM it
    handled inside a gc callback; the handler it forwarded to returned, and its own `Preempted` was
    dropped. It then refuses to go on (an evaluation, an export, training): `Preempted` again."""
    from sigterm_in_gc_callback import sigterm_inside_a_gc_callback

    from prefect_jax.training.errors import Preempted

    calls, _ = sigterm_handler
    trainer = Trainer(job_config(max_steps=40, every_steps=20))
    try:
        trainer.restore_or_init()
        trainer.train_until_checkpoint()
        sigterm_inside_a_gc_callback()  # between tasks: the guard handles it at once
        _wait_in_ordinary_code(0.5)
        assert calls[:2] == ["handler", "dropped Preempted"], calls
        for go_on in (
            trainer.evaluate_if_new,
            trainer.train_until_checkpoint,
            trainer.restore_or_init,
        ):
            with pytest.raises(Preempted, match="preempted at step 20"):
                go_on()
        assert committed_steps(trainer.job.storage.checkpoint_dir) == [20]
    finally:
        trainer.close()


def test_a_sigterm_that_breaks_an_import_in_the_command_still_ends_it_terminated(
    sigterm_handler, monkeypatch, capsys
):
    """The command's SIGTERM handler raises SystemExit wherever the main thread is: inside a C
    extension's import (pydantic-core's, in the `start` case above on busy cores) that became
    pyo3's `PanicException`, a BaseException, and the command exited 1. It exits 143, saying so."""
    from prefect_jax import cli
    from prefect_jax.cli import commands

    class PanicException(BaseException):  # (pyo3 makes one per extension)
        pass

    def run_broken_by_a_sigterm(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the command's handler: SystemExit(143)
            _wait_in_ordinary_code(30)
        except SystemExit as exc:
            raise PanicException("failed to import `datetime` C API") from exc

    monkeypatch.setattr(commands, "cmd_run", run_broken_by_a_sigterm)
    assert (
        cli.main(["run", "--program", "programs:tiny", "--job", "broken", "--storage", "unused"])
        == 143
    )
    assert "terminated by signal 15; the newest committed step is kept" in capsys.readouterr().err


def test_a_notice_before_any_checkpoint_says_nothing_was_being_written_not_a_timeout(
    sigterm_handler, job_config, caplog
):
    """A SIGTERM after the restore of a new job, before its first save: nothing was being
    written, so nothing was abandoned. Before, the ending logged an ERROR that "the checkpoint of
    step 0 did not commit within 25s ... step None stays the newest valid one" (a helper's
    stress run saw it on every such notice)."""
    import logging

    from prefect_jax.training.errors import Preempted

    calls, _ = sigterm_handler
    trainer = Trainer(job_config(max_steps=40, every_steps=20))
    try:
        trainer.restore_or_init()
        with caplog.at_level(logging.WARNING), pytest.raises(Preempted) as raised:
            os.kill(os.getpid(), signal.SIGTERM)  # between tasks: the guard handles it at once
            _wait_in_ordinary_code(30)
        assert calls == ["handler"], calls
        assert "no checkpoint was being written" in str(raised.value), raised.value
        assert raised.value.committed is None
        assert (
            "SIGTERM at step 0: no checkpoint was being written; no step was committed yet: the "
            "rerun starts from the beginning" in caplog.text
        ), caplog.text
        assert "did not commit" not in caplog.text and "ERROR" not in caplog.text, caplog.text
    finally:
        trainer.close()
