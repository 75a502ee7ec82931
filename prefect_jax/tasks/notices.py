"""A SIGTERM in a flow run that trains: Prefect's bridge stays the handler, the trainer is told.

Prefect's flow engine installs its SIGTERM bridge on the main thread, which raises
`TerminationSignal` wherever that thread is; only with the bridge installed does the flow-run
process acknowledge a runner's cancel or reschedule, so that the run ends Cancelled or is
rescheduled rather than Crashed or killed (docs/upstream.md 4). So the tasks leave it in place:
every call of a live trainer runs on the trainer thread (`prefect_jax.training.trainer_thread`)
while the task waits (`call`), and the exception lands in that wait. There, or in a flow's body
between task runs (`prefect_jax.flows.tags.flow_body`), `end_on_notice` tells each live trainer's
guard: a trainer in its loop or a save checkpoints the step in flight and ends its call; one
elsewhere (an evaluation, an export, between tasks) is given the ending once its call is done (the
saves in flight commit, MLflow's run closes KILLED, the lease is freed), within the job's
`sigterm_grace_secs`. The exception then goes on, and Prefect ends the run as the runner asked.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import time
from collections.abc import Callable

from prefect.exceptions import TerminationSignal

from prefect_jax.training import trainer_thread
from prefect_jax.training.errors import Preempted
from prefect_jax.training.preemption import note_received

# How long the caller waits for the trainer's call in flight to end on its own (the loop checkpoints
# at its next step; an evaluation or an export runs to its end) before the ending runs beside it:
# the share of the grace period left to the ending itself.
CALL_SHARE_OF_GRACE = 0.5
# How long a notice waits for a call in flight where no trainer of the process holds its job (an
# evaluator's evaluation gives up at its next batch).
IDLE_WAIT_SECS = 5.0


def call(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)`, a live trainer's method, on the trainer thread, the caller waiting;
    a SIGTERM met in the wait ends the trainers' attempts first (`end_on_notice`)."""
    if trainer_thread.on_trainer_thread():
        return fn(*args, **kwargs)
    pending = trainer_thread.submit(fn, *args, **kwargs)
    try:
        trainer_thread.wait(pending)
    except (TerminationSignal, KeyboardInterrupt) as notice:  # (Ctrl-C: ended as a notice too)
        end_on_notice(notice)
        raise
    try:
        return trainer_thread.outcome(pending)
    except Preempted:
        # Another JAX process's notice (`PreemptionGuard.adopt`): the trainer checkpointed the
        # same step; the notice goes on here as this process's own SIGTERM would.
        _raise_as_a_sigterm()
        raise


def _raise_as_a_sigterm() -> None:
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):  # Prefect's bridge: raises `TerminationSignal`
        handler(signal.SIGTERM, None)


def the_notice(exc: BaseException) -> TerminationSignal | KeyboardInterrupt | None:
    """The SIGTERM's `TerminationSignal` (or Ctrl-C's `KeyboardInterrupt`) that `exc` is, or
    that was being handled where `exc` was raised: Prefect's crash handling can fail on it, when
    the signal lands while Prefect creates a task run ("Task run is not set")."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (TerminationSignal, KeyboardInterrupt)):
            return exc
        seen.add(id(exc))
        exc = exc.__context__
    return None


def end_on_notice(notice: TerminationSignal | KeyboardInterrupt) -> None:
    """Each live trainer of this process that holds its job checkpoints the step in flight or
    lets its saves in flight commit, closes MLflow's run KILLED and frees its lease (once per
    notice; a second SIGTERM meanwhile changes nothing)."""
    from prefect_jax.training.live import live_trainers

    if getattr(notice, "prefect_jax_ended", False):
        return
    notice.prefect_jax_ended = True
    signum = getattr(notice, "signal", signal.SIGINT)
    note_received(signum)  # (what the command and the flows' state hooks say the run ended of)
    trainers = [t for t in live_trainers() if t.guard.active and t.guard.driven]
    for t in trainers:
        t.guard.notice(signum)
    grace = max((t.config.train.sigterm_grace_secs for t in trainers), default=IDLE_WAIT_SECS)
    # The call in flight ends: the loop checkpoints at its next step, a save once handed off, an
    # evaluation gives up at its next batch; an export runs to its end.
    _until(trainer_thread.idle, time.monotonic() + grace * CALL_SHARE_OF_GRACE)
    for t in trainers:
        if t.ending.preempted is not None:  # it checkpointed in its loop or its save
            continue
        if trainer_thread.idle(0):  # the ending on the trainer's thread, after its call
            ending = trainer_thread.submit(t.guard.handle_if_pending)
            _until(functools.partial(trainer_thread.wait, ending), time.monotonic() + grace + 5)
        else:  # (an export still going: the ending beside it, bounded itself)
            with contextlib.suppress(Preempted):
                t.guard.handle_if_pending()


def _until(wait: Callable[[float], bool], deadline: float) -> None:
    """`wait(seconds left)` until it returns True or `deadline` passes; a SIGTERM again meanwhile
    (its `TerminationSignal`) does not cut it short."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            if wait(left):
                return
        except TerminationSignal:
            continue
