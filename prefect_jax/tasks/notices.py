"""A SIGTERM in a flow run that trains: Prefect's bridge stays the handler, the trainer is told.

Prefect's flow engine installs its SIGTERM bridge on the main thread, which raises
`TerminationSignal` wherever that thread is; only with the bridge installed does the flow-run
process acknowledge a runner's cancel or reschedule, so that the run ends Cancelled or is
rescheduled rather than Crashed or killed (docs/upstream.md 4). So the tasks leave it in place:
every call of a live trainer runs on the trainer thread (`prefect_jax.training.trainer_thread`)
while the task waits (`call`), and the exception lands in that wait. There, or in a flow's body
between task runs (`prefect_jax.flows.tags.flow_body`), `end_on_notice` tells each live trainer's
guard: a trainer in its loop or a save checkpoints the step in flight and ends its call; one
between tasks, or in an evaluation (which gives up at its next batch), is given the ending on its
thread (the saves in flight commit, MLflow's run closes KILLED, the lease is freed, within the
job's `sigterm_grace_secs`); another call that neither trains, saves nor ends the attempt (a
restore, an export, a collective) still going after `GIVE_UP_SECS` has the ending run beside it.
The exception then goes on, and Prefect ends the run as the runner asked.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import time
from collections.abc import Callable

from prefect.exceptions import TerminationSignal

from prefect_jax.training import trainer_thread
from prefect_jax.training.errors import Preempted
from prefect_jax.training.preemption import note_received

logger = logging.getLogger("prefect_jax.trainer")

# How long a notice waits for a call in flight that neither trains, saves nor ends the attempt
# (`call_cuttable`: an evaluation gives up at its next batch sooner) before the ending runs beside
# it; and, with no trainer holding its job here, for an evaluator's evaluation to give up.
GIVE_UP_SECS = 5.0
POLL_SECS = 0.1  # how often that wait looks at what the trainer's call is doing


def call(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)`, a live trainer's method, on the trainer thread, the caller waiting;
    a SIGTERM met in the wait ends the trainers' attempts first (`end_on_notice`)."""
    return _call(fn, args, kwargs, cuttable=False)


def call_cuttable(fn: Callable, *args, **kwargs):
    """`call`, for a method that neither trains, saves nor ends the attempt (a restore, an
    evaluation, an export, a collective): a notice has the ending run beside it after
    `GIVE_UP_SECS`, as the signal's handler would interrupt it."""
    return _call(fn, args, kwargs, cuttable=True)


def _call(fn: Callable, args: tuple, kwargs: dict, cuttable: bool):
    if trainer_thread.on_trainer_thread():
        return fn(*args, **kwargs)
    try:
        pending = trainer_thread.submit(fn, *args, cuttable=cuttable, **kwargs)
        trainer_thread.wait(pending)
    except (TerminationSignal, KeyboardInterrupt) as notice:  # (Ctrl-C: ended as a notice too)
        end_on_notice(notice)
        raise
    try:
        return trainer_thread.outcome(pending)
    except Preempted as preempted:
        if preempted.by_another:
            # Another JAX process's notice (`PreemptionGuard.adopt`): the trainer checkpointed the
            # same step; the notice goes on here as this process's own SIGTERM would.
            _raise_as_a_sigterm()
        raise


def within(fn: Callable, timeout: float, *args, **kwargs):
    """`call`, for up to `timeout` seconds of the trainer thread's calls before it (one a notice
    cut short may still run); then here, on the caller's thread, unless it began there."""
    if trainer_thread.on_trainer_thread():
        return fn(*args, **kwargs)
    pending = trainer_thread.submit(fn, *args, **kwargs)
    _until(functools.partial(trainer_thread.wait, pending), time.monotonic() + timeout)
    if timeout > 0 and not pending.done.is_set():
        logger.warning("the trainer's thread busy after %.0fs: %s runs beside it", timeout, fn)
    if pending.claim():
        pending.run()
    else:  # begun there meanwhile
        _until(functools.partial(trainer_thread.wait, pending), None)
    return trainer_thread.outcome(pending)


def end_if_notice(exc: BaseException) -> None:
    """Where `exc` is (or comes of) a SIGTERM's notice, or Ctrl-C: `end_on_notice`."""
    notice = the_notice(exc)
    if notice is not None:
        end_on_notice(notice)


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
    lets its saves in flight commit, closes MLflow's run KILLED and frees its lease; then the
    caller raises the notice on. Once per notice; never raises (whatever fails is logged: the
    notice must go on to Prefect, which ends the run as it was asked)."""
    from prefect_jax.training.live import live_trainers

    if getattr(notice, "prefect_jax_ended", False):
        return
    notice.prefect_jax_ended = True
    signum = getattr(notice, "signal", signal.SIGINT)
    note_received(signum)  # (what the command and the flows' state hooks say the run ended of)
    trainers = live_trainers()
    for t in trainers:
        t.guard.notice(signum)  # (a loop, a save or an evaluation in flight reads it)
    for t in trainers:
        try:
            if t.guard.active and t.guard.driven:
                _end(t)
        except Exception:  # noqa: BLE001 - see the docstring
            logger.exception("job %s: the ending of its attempt failed", t.config.job)
    # (an evaluator's evaluation in flight, its job held by no trainer here, gives up too)
    _until(trainer_thread.idle, time.monotonic() + GIVE_UP_SECS)
    for t in trainers:
        t.guard.drop_stale_notice()


def _end(t) -> None:
    """`end_on_notice` for one trainer whose guard its caller drives.

    The call in flight ends first: in the loop or a save the trainer checkpoints the step in
    flight and ends its call itself (its ending bounded by the grace period; the step in flight
    and the save come first, unbounded, as where the guard is the signal's handler); an evaluation
    gives up at its next batch; a call that neither trains, saves nor ends the attempt
    (`call_cuttable`) has the ending run beside it after `GIVE_UP_SECS`; the others run to their
    end. Then the ending runs on the trainer thread, unless it ran already."""
    give_up_by = time.monotonic() + GIVE_UP_SECS
    while not trainer_thread.idle(0):
        running = trainer_thread.running()
        if running is not None and running.cuttable and time.monotonic() >= give_up_by:
            break
        _until(trainer_thread.idle, time.monotonic() + POLL_SECS)
    if t.guard.handling or not t.guard.active:  # its ending ran, or it finished meanwhile
        return
    if trainer_thread.idle(0):
        ending = trainer_thread.submit(t.guard.handle_if_pending)
        # (bounded by the grace period itself)
        _until(functools.partial(trainer_thread.wait, ending), None)
    else:
        with contextlib.suppress(Preempted):
            t.guard.handle_if_pending()


def _until(wait: Callable[[float | None], bool], deadline: float | None) -> None:
    """`wait(seconds left)` until it returns True or `deadline` passes (None: until it returns
    True); a SIGTERM again meanwhile (its `TerminationSignal`) does not cut it short."""
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return
        try:
            if wait(left):
                return
        except TerminationSignal:
            continue
