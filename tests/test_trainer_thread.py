"""The trainer thread and the notices its callers meet (`prefect_jax.training.trainer_thread`,
`prefect_jax.tasks.notices`): a trainer's call runs on one thread in a copy of the caller's
context; a SIGTERM's exception lands in the caller's wait, and the notice goes on only once the
trainer has ended its attempt. The flows' whole path (a deployment cancelled from the UI, pods
SIGTERMed, Prefect's task-run creation interrupted) is in test_deployment_cancel, test_multiprocess,
test_fault_holes and test_sigterm_delivery.
"""

from __future__ import annotations

import contextvars
import os
import signal
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from prefect.exceptions import TerminationSignal

from prefect_jax.tasks import notices
from prefect_jax.training import live, trainer_thread
from prefect_jax.training.errors import Preempted
from prefect_jax.training.preemption import PreemptionGuard
from prefect_jax.training.tracking import Tracker

_where = contextvars.ContextVar("where", default="unset")


def test_a_call_runs_on_the_trainer_thread_in_the_callers_context():
    token = _where.set("the caller's")
    try:
        seen = notices.call(lambda: (threading.current_thread().name, _where.get()))
    finally:
        _where.reset(token)
    assert seen == (trainer_thread.THREAD_NAME, "the caller's")
    # From the trainer thread itself: at once (a call never waits for itself).
    assert notices.call(notices.call, trainer_thread.on_trainer_thread) is True
    with pytest.raises(KeyError, match="raised there"):
        notices.call(lambda: {}["raised there"])
    assert trainer_thread.idle(5)


@pytest.fixture
def sigterm_as_prefect_raises_it(monkeypatch):
    """SIGUSR1 here raises what Prefect's SIGTERM bridge raises (`TerminationSignal`), on the main
    thread wherever it is; a fake trainer is this process's live one, its guard driven by its
    caller. Yields (trainer, what happened, in order)."""
    events: list[str] = []

    def bridge(signum, frame):
        events.append("the bridge raised")
        raise TerminationSignal(signal=signal.SIGTERM)

    previous = signal.signal(signal.SIGUSR1, bridge)
    trainer = SimpleNamespace(
        config=SimpleNamespace(job="fake", train=SimpleNamespace(sigterm_grace_secs=25.0))
    )

    def ending():
        events.append("the ending ran")
        trainer.guard.forward()
        raise Preempted(7, True, signal.SIGTERM)

    trainer.guard = PreemptionGuard(ending)
    monkeypatch.setattr(live, "_live", {"fake": trainer})
    monkeypatch.setattr(notices, "note_received", lambda signum: None)
    try:
        yield trainer, events
    finally:
        signal.signal(signal.SIGUSR1, previous)
        assert trainer_thread.idle(30)


def _notice() -> None:
    os.kill(os.getpid(), signal.SIGUSR1)


def test_a_notice_in_the_loop_goes_on_only_once_the_trainer_has_checkpointed(
    sigterm_as_prefect_raises_it, monkeypatch
):
    """The notice lands in the task's wait while the trainer is in its loop: the caller waits for
    the step in flight and its checkpoint (longer than an evaluation is given to give up), and
    only then raises the notice on; the trainer's call ends with its `Preempted`."""
    trainer, events = sigterm_as_prefect_raises_it
    monkeypatch.setattr(notices, "GIVE_UP_SECS", 0.2)

    def train_until_checkpoint():
        trainer.guard.install()  # (on the trainer thread: no handler, driven by the caller)
        with trainer.guard.deferred():
            _notice()
            while not trainer.guard.requested:
                time.sleep(0.01)
            events.append("the loop saw it")
            time.sleep(2.0)  # the step in flight and its save: longer than an evaluation is given
            events.append("the step in flight saved")
        trainer.guard.handle_if_pending()

    with pytest.raises(TerminationSignal):
        notices.call(train_until_checkpoint)
    assert events == [
        "the bridge raised",
        "the loop saw it",
        "the step in flight saved",
        "the ending ran",
    ]
    assert not trainer.guard.active


def test_a_signal_the_kernel_hands_to_another_thread_still_reaches_the_waiting_caller(
    sigterm_as_prefect_raises_it,
):
    """The kernel may deliver a process's signal to any thread: here, to the trainer thread
    (`pthread_kill`). Python runs the handler on the main thread, which waits in slices, so the
    notice reaches the loop while it trains, not once its call has ended (a blocked wait: the
    whole interval, past a preemption's grace period)."""
    trainer, events = sigterm_as_prefect_raises_it

    def train_until_checkpoint():
        trainer.guard.install()
        with trainer.guard.deferred():
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # to this thread
            deadline = time.monotonic() + 10
            while not trainer.guard.requested and time.monotonic() < deadline:
                time.sleep(0.01)
            events.append("the loop saw it" if trainer.guard.requested else "the loop ended")
        trainer.guard.handle_if_pending()

    with pytest.raises(TerminationSignal):
        notices.call(train_until_checkpoint)
    assert events == ["the bridge raised", "the loop saw it", "the ending ran"]


def test_a_first_runs_wait_for_its_mlflow_run_lets_a_signal_through(sigterm_as_prefect_raises_it):
    """A job's first restore task waits on the flow run's main thread, up to `LINK_WAIT_SECS`,
    for MLflow to make the job's run (its link goes out with the restore). A signal the kernel
    hands to another thread meanwhile reaches Prefect's bridge at once, not when the wait ends
    (a minute, against MLflow that does not answer)."""
    tracker = Tracker(None, "experiment", "job", enabled=False)  # (no worker process)
    tracker.enabled, tracker._started = True, Future()  # `start` asked; MLflow not answered
    threading.Timer(0.2, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)).start()
    began = time.monotonic()
    with pytest.raises(TerminationSignal):
        tracker.wait_started(10)
    assert time.monotonic() - began < 5
    tracker._started.set_result({"run_id": "r"})
    assert tracker.wait_started(10)


def test_a_notice_between_calls_ends_the_attempt_on_the_trainer_thread(
    sigterm_as_prefect_raises_it,
):
    """A notice between task runs (here: in a call that had just returned), or in an evaluation
    that gives up: the ending runs on the trainer thread before the notice goes on."""
    trainer, events = sigterm_as_prefect_raises_it
    notices.call(trainer.guard.install)
    ran_on = []

    def ending_on_its_thread():
        ran_on.append(threading.current_thread().name)

    trainer.guard._on_signal = ending_on_its_thread
    with pytest.raises(TerminationSignal) as raised:
        _notice()
        time.sleep(5)  # (the handler raises here)
    notices.end_on_notice(raised.value)
    assert ran_on == [trainer_thread.THREAD_NAME]
    assert events == ["the bridge raised"]


def test_a_trainer_that_finished_is_not_ended_by_a_later_notice(sigterm_as_prefect_raises_it):
    trainer, events = sigterm_as_prefect_raises_it
    notices.call(trainer.guard.install)
    notices.call(trainer.guard.uninstall)  # `Trainer.finish`
    notices.end_on_notice(TerminationSignal(signal=signal.SIGTERM))
    assert events == []


def test_a_call_given_up_on_runs_once_here_and_never_again_there():
    """`within`: a call whose turn does not come in time runs on the caller's thread, once (the
    trainer thread skips it); one that came in time runs there."""
    ran: list[str] = []
    release = threading.Event()
    trainer_thread.submit(release.wait, 30)  # a call a notice cut short, still going
    notices.within(lambda: ran.append(threading.current_thread().name), 0.2)
    release.set()
    assert trainer_thread.idle(30)
    assert ran == [threading.main_thread().name]
    notices.within(lambda: ran.append(threading.current_thread().name), 30)
    assert ran == [threading.main_thread().name, trainer_thread.THREAD_NAME]


def test_a_notice_a_trainer_met_not_holding_its_job_is_gone_once_it_holds_it_again(
    sigterm_as_prefect_raises_it,
):
    """An evaluator's trainer (its guard not installed) is told a notice, so that its evaluation
    gives up; made to hold its job again in a process that went on, it starts with no notice. A
    notice met while holding it stays (its trainer refuses to go on)."""
    trainer, events = sigterm_as_prefect_raises_it
    trainer.guard.notice(signal.SIGTERM)
    assert trainer.guard.requested
    notices.call(trainer.guard.install)
    assert not trainer.guard.requested
    trainer.guard.notice(signal.SIGTERM)
    notices.call(trainer.guard.uninstall)
    notices.call(trainer.guard.install)
    assert trainer.guard.requested


def test_another_processs_notice_goes_on_as_this_processs_sigterm(monkeypatch):
    """A trainer that checkpointed on another JAX process's notice ends its call with a
    `Preempted` saying so: the caller raises the installed SIGTERM handler's exception (Prefect's
    bridge) as a SIGTERM here would; a `Preempted` of this process's own notice goes on as it is."""
    calls = []

    def bridge(signum, frame):
        calls.append(signum)
        raise TerminationSignal(signal=signum)

    previous = signal.signal(signal.SIGTERM, bridge)
    try:

        def preempted(by_another):
            raise Preempted(7, True, signal.SIGTERM, by_another=by_another)

        with pytest.raises(TerminationSignal):
            notices.call(preempted, True)
        with pytest.raises(Preempted):
            notices.call(preempted, False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert calls == [signal.SIGTERM]


def test_the_notice_is_found_behind_the_error_prefects_crash_handling_raised():
    """Prefect's crash handling can fail on a SIGTERM that lands while it creates a task run: the
    flow's body finds the notice as the context of that error."""
    try:
        try:
            raise TerminationSignal(signal=signal.SIGTERM)
        except TerminationSignal:
            raise ValueError("Task run is not set") from None
    except ValueError as exc:
        error = exc
    assert error.__context__ is not None
    assert isinstance(notices.the_notice(error), TerminationSignal)
    assert notices.the_notice(ValueError("no notice")) is None
