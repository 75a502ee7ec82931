"""An evaluation of the live step whose save is still in flight: recorded once the step commits.

A trainer in local mode evaluates the step it just saved while Orbax still writes it. A step is
recorded (logged, written to the eval records, exported) only once it is committed, so that a
crash before the commit leaves nothing that says it was evaluated: the rerun evaluates it
again. Training does not wait for the commit: the loop records the evaluation once the save has
landed, or the next save, evaluation, export or end of the trainer does. This module never
imports prefect.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from prefect_jax.training.evaluation import EvalResult

logger = logging.getLogger("prefect_jax.trainer")

OnRecorded = Callable[[EvalResult], None]


def may_record_later(is_final: bool, decides: bool, processes: int) -> bool:
    """Whether an evaluation of the live step may be recorded once its step commits, training
    going on meanwhile: not when something decides on it first (`decides`: early stopping, eval
    hooks; a stop they ask for ends the job at this step), at the final step, or with several
    processes (their commit is collective)."""
    return not is_final and not decides and processes == 1


@contextlib.contextmanager
def phase_within(ledger, phase: str, inside: str | None):
    """Time spent in the block is `phase` time in the goodput `ledger`, taken off `inside` (the
    phase the block runs within, whose own clock counts it too; None: none)."""
    started = time.perf_counter()
    try:
        with ledger.phase(phase):
            yield
    finally:
        if inside is not None:
            ledger.add(inside, -(time.perf_counter() - started))


class PendingEvaluation:
    """The one evaluation waiting for its step's commit, and what to call once it is recorded.

    Args:
        job: the trainer's `Job` (its saves in flight, its commits, its goodput ledger).
        record: records a result of a committed step, then calls its `on_recorded`
            (`Evaluations.record`); it may raise, and is retried (records and MLflow logs are
            idempotent).
    """

    def __init__(self, job, record: Callable[[EvalResult, OnRecorded | None], EvalResult]):
        self.job, self._record = job, record
        self.held: tuple[EvalResult, OnRecorded | None] | None = None
        self._taking = threading.Lock()
        self.from_loop = True  # off after a failed try there: the next save records it, or raises

    @property
    def step(self) -> int | None:
        """The step of the evaluation waiting, or None: none is."""
        return None if self.held is None else self.held[0].step

    def hold(self, result: EvalResult, on_recorded: OnRecorded | None) -> EvalResult:
        """Keep `result` until its step commits; returns it marked ``pending_commit``."""
        pending = result.model_copy(update={"pending_commit": True})
        self.held, self.from_loop = (pending, on_recorded), True
        return pending

    def drop(self) -> None:
        """Forget the evaluation waiting (the rerun evaluates its step)."""
        self.held = None

    def wait_committed(self, inside: str | None = None) -> None:
        """Wait for the saves in flight, as checkpoint time in the goodput ledger (not as time of
        `inside`, the phase this runs in)."""
        with phase_within(self.job.goodput, "checkpoint", inside):
            self.job.wait_committed()

    def record_from_loop(self) -> None:
        """From the training loop: `record_if_landed`, unless a try there failed already."""
        if self.held is not None and self.from_loop:
            self.record_if_landed(inside="train")

    def record_if_landed(self, inside: str | None = None) -> None:
        """From the training loop (or a SIGTERM's end): record the pending evaluation if its save
        has landed; a failure is retried by the next save, which waits for it. The record is
        evaluation time in the goodput ledger (not time of `inside`, the phase this runs in)."""
        if self.held is None or not self.job.save_landed():
            return
        step = self.held[0].step
        try:
            with phase_within(self.job.goodput, "eval", inside):
                self.record(wait=False)
        # not the training's to end: the next save records it, or raises
        except Exception as exc:  # noqa: BLE001
            self.from_loop = False
            logger.warning(
                "could not record the evaluation of step %d yet (the next save tries again): %r",
                step,
                exc,
            )

    def record(self, wait: bool, inside: str | None = None) -> EvalResult | None:
        """Record the pending evaluation if its step committed (`wait`: once the saves in flight
        have landed; `inside`: the goodput phase this runs in); the recorded result, or None
        (nothing pending, or its step did not commit)."""
        if self.held is None:
            return None
        if wait:
            self.wait_committed(inside)
        # Taken off first, by one thread: the trainer's, or a notice's ending run beside it
        # (`prefect_jax.tasks.notices`); the other finds nothing pending and returns at once,
        # maybe before the record lands (not held through the record: a hung MLflow or storage
        # would hang both).
        with self._taking:
            held, self.held = self.held, None
        if held is None:
            return None
        result, on_recorded = held
        if not self.job.is_committed(result.step):
            logger.error("step %d did not commit: its evaluation is not recorded", result.step)
            return None
        try:
            return self._record(result.model_copy(update={"pending_commit": False}), on_recorded)
        except Exception:
            self.held = held  # retried (records and MLflow logs are idempotent)
            raise

    def record_or_warn(self) -> None:
        """At the end of a trainer (one that did not finish): the pending evaluation recorded if
        its step commits; if that fails, the rerun evaluates the step."""
        if self.held is None:
            return
        try:
            self.record(wait=True)
        # ending anyway: what stops the record is not to hide why it ends
        except Exception as exc:  # noqa: BLE001
            logger.warning(
                "the evaluation of step %d was not recorded (the rerun evaluates it): %r",
                self.held[0].step,
                exc,
            )
            self.held = None
