"""How a trainer's attempt at its job ends: finished, closed, or preempted by a SIGTERM.

A preemption notice (SIGTERM, taken by the trainer's `PreemptionGuard`) checkpoints the live
step or lets the save in flight commit, within `sigterm_grace_secs`; then the MLflow run closes
KILLED, the lease is freed and the signal goes on (`PreemptionGuard.forward`). Each end is written
to the goodput ledger, where a process of the job that went away without a word counts as a kill
(the job's next attempts back up between checkpoints). This module never imports prefect.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

from prefect_jax.training.cluster import failed_processes, lost_process, say_goodbye
from prefect_jax.training.cluster import mark_finished as mark_cluster_finished
from prefect_jax.training.compile_cache_mirror import END_FLUSH_SECS, SIGTERM_FLUSH_SECS
from prefect_jax.training.errors import LeaseLostError, Preempted
from prefect_jax.training.goodput_summary import (
    CLOSED,
    ENDED_BY_STATUS,
    FAILED,
    LOST_PROCESS,
    PREEMPTED,
)
from prefect_jax.training.lease_finishing import release_after
from prefect_jax.training.preemption import note_resumes_at

if TYPE_CHECKING:
    from prefect_jax.training.trainer import Trainer

logger = logging.getLogger("prefect_jax.trainer")

Rows = list[tuple[str, float, int]]
# How long a SIGTERM's ending waits for the commit events of its saves (the commit itself it waits
# for), and for the record of an evaluation whose step committed (it publishes an event): sending
# an event may wait on a lock that the code the signal interrupted holds (`on_sigterm`).
EVENTS_WAIT_SECS = 1.0
RECORD_WAIT_SECS = 5.0
# How long a log line of a SIGTERM's ending may take (`on_sigterm`'s `say`).
LOG_WAIT_SECS = 2.0


def within(fn, timeout: float) -> bool:
    """Run `fn` on a helper thread, in a copy of the caller's context (a Prefect run's, for its
    logger and events); True if it returned within `timeout` seconds."""
    worker = threading.Thread(target=contextvars.copy_context().run, args=(fn,), daemon=True)
    worker.start()
    worker.join(timeout=max(0.0, timeout))
    return not worker.is_alive()


def signal_name(signum: int | None) -> str:
    """``"SIGTERM"`` (also for None: a notice with no number), ``"SIGINT"`` for Ctrl-C."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "SIGTERM" if signum is None else f"signal {signum}"


def _newest_kept(newest: int | None) -> str:
    return (
        "no step was committed yet: the rerun starts from the beginning"
        if newest is None
        else f"step {newest} stays the newest valid one"
    )


def thread_stacks() -> str:
    """Where every thread of the process is now, named, innermost call last: what a wait that
    ran out of time was waiting on (`sys._current_frames`, the interpreter's own view)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(
        f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)).rstrip()
        for ident, frame in sys._current_frames().items()
    )


class AttemptEnd:
    """The end of one trainer's attempt (see `Trainer.finish`, `Trainer.close`)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        # (step, committed, signal) of the notice handled, once forwarded
        self.preempted: tuple | None = None

    def stop_if_preempted(self) -> None:
        """Raise `Preempted` if this trainer handled a notice: where the handler it went on to
        raised in a place that dropped that (a gc callback: `deliver_lost_notices` sends the signal
        again, a moment later), nothing more of the job is done meanwhile."""
        if self.preempted is not None:
            raise Preempted(*self.preempted)

    def on_sigterm(self, rows: Rows | None = None) -> None:
        """A preemption notice: checkpoint the live step (in the loop, `rows` are its interval's
        train metrics) or let its save in flight commit (anywhere else: during an evaluation, an
        export, between tasks), within `sigterm_grace_secs`; say which step is the newest
        committed one; close the MLflow run KILLED, free the lease, forward the signal.

        Anywhere else, this may run beside code not the trainer's (Prefect sending an event
        between tasks; where the guard is the signal's handler, interrupted by it), which may
        hold a plain lock that calls of the ending need too (an evaluation's record publishes an
        event); such a call would wait for ever, and Prefect's runner kills a cancelled run's
        process 30 s after its SIGTERM. So every call that may wait on others (the commit and its
        events, the record, MLflow, its log lines) runs on a helper thread, bounded by the grace
        period (`bounded`, `say`); the rest, the trainer's own, runs here."""
        t, job = self.trainer, self.trainer.job
        pending = t.evaluations.pending
        grace, started = t.config.train.sigterm_grace_secs, time.monotonic()
        deadline = started + grace
        notice = signal_name(t.guard.signum)  # (Ctrl-C in a notebook ends the same way: SIGINT)

        def bounded(fn, at_least: float) -> bool:
            """`fn` within what is left before `deadline`, or `at_least` seconds."""
            return within(fn, max(at_least, deadline - time.monotonic()))

        stuck: list[bool] = []

        def say(level: int, msg: str, *args) -> None:
            """Log, within `LOG_WAIT_SECS`: the signal may have interrupted the main thread inside
            a log handler whose lock another thread waits on while holding one that handler needs
            (rich's progress display), or whose lock is plain (Prefect's API log worker, for
            loggers sent to Prefect's API). Once a line is stuck, the next ones are not tried."""
            if not stuck and not within(lambda: logger.log(level, msg, *args), LOG_WAIT_SECS):
                stuck.append(True)

        committed, waited = False, None  # (None: the commit was not waited for)
        try:
            # (None: no save just ended here)
            saved_rows = rows if rows is not None else t.intervals.rows_saving
            if rows is not None and pending.held is not None:
                try:
                    pending.record(wait=True)
                # then no newer step: the rerun resumes from that one and evaluates it
                except Exception as exc:  # noqa: BLE001
                    say(
                        logging.WARNING,
                        "%s at step %d: the evaluation of step %d could not be recorded (%r): "
                        "not checkpointing step %d",
                        notice,
                        t.step,
                        pending.step,
                        exc,
                        t.step,
                    )
                    pending.drop()
                    rows, saved_rows = None, None
            if rows is not None:
                say(
                    logging.WARNING,
                    "%s at step %d: checkpointing it (grace %.0fs)",
                    notice,
                    t.step,
                    grace,
                )
                # checks the lease
                t.intervals.save(rows, preemption=t.policy.is_off_cadence(t.step))
            else:
                # taken over: the job's records below are not this process's to write
                with contextlib.suppress(LeaseLostError):
                    job.verify_lease()
                say(
                    logging.WARNING,
                    "%s at step %s, not training (its checkpoint is taken): letting it commit "
                    "(grace %.0fs)",
                    notice,
                    t.step,
                    grace,
                )
            # (None: no save was in flight: nothing was abandoned, say so, not a commit timing out)
            writing = rows is not None or not job.save_landed()
            # (the commit's events may wait on a lock the interrupted code holds: not for long)
            # (started even with no time left: the stacks below then show where the commit is)
            waited = within(
                lambda: job.wait_committed(events_wait=EVENTS_WAIT_SECS),
                deadline - time.monotonic(),
            )
            committed = waited and t.step is not None and job.is_committed(t.step)
            committed = committed or (None if waited and not writing else False)
            if pending.held is not None:  # an evaluation whose step was committing: recorded if it
                # did, before the run closes (else the rerun evaluates that step)
                evaluated = pending.step
                wait = min(RECORD_WAIT_SECS, max(0.0, deadline - time.monotonic()))
                recorded = within(pending.record_if_landed, wait)
                pending.drop()  # (a record still running is the last: no later close records it)
                if not recorded:
                    say(
                        logging.WARNING,
                        "the evaluation of step %s was not recorded within %.0fs: left to "
                        "finish as the process ends (else the rerun evaluates that step again)",
                        evaluated,
                        wait,
                    )
            # what this attempt compiled, for the rerun (on another node)
            if t.compile_cache is not None:
                left = max(0.0, deadline - time.monotonic())
                t.compile_cache.flush(min(SIGTERM_FLUSH_SECS, left))
            if committed:
                note_resumes_at(t.step)  # (the command's last line says it)
                say(
                    logging.WARNING,
                    "step %d committed in %.2fs after %s",
                    t.step,
                    time.monotonic() - started,
                    notice,
                )
                if saved_rows:  # the interval's train metrics (the checkpoint has them too)
                    bounded(lambda: t.intervals.log_train_rows(saved_rows), at_least=0.5)
            elif committed is None:
                newest = job.newest_committed()
                note_resumes_at(newest)
                say(
                    logging.WARNING,
                    "%s at step %s: no checkpoint was being written; %s",
                    notice,
                    t.step,
                    _newest_kept(newest),
                )
            else:
                # (a commit still running when the grace ran out: where each thread was, so that
                # a stall, not a slow disk, can be told and reported)
                say(
                    logging.ERROR,
                    "the checkpoint of step %s did not commit within %.0fs: abandoned; %s%s",
                    t.step,
                    grace,
                    _newest_kept(job.newest_committed()),
                    "" if waited else "; each thread when the grace ran out:\n" + thread_stacks(),
                )
            job.goodput.end(PREEMPTED)
            bounded(self.log_goodput, at_least=0.5)
            # MLflow may be slow (or its thread busy): never much past the grace period.
            bounded(lambda: job.tracker.finish("KILLED"), at_least=1.0)
        finally:
            # Whatever failed above (storage going away with the node, say), the notice goes on:
            # else the guard, handling it still, would take no later SIGTERM either.
            with contextlib.suppress(Exception):
                if waited is False:  # the save goes on writing: no rerun takes the job meanwhile
                    writes_end = lambda: job.wait_committed(ending=True, events_wait=0)  # noqa: E731
                    hold = lambda: release_after(job.lease, writes_end, f"step {t.step}")  # noqa: E731
                    bounded(hold, at_least=1.0)  # (it writes the lease: storage may hang)
                job.lease.release()  # (returns at once once released, or while finishing)
            self.preempted = (t.step, committed, t.guard.signum)
            t.forget_live_state()
            t.guard.forward()
        raise Preempted(*self.preempted, by_another=t.guard.adopted)

    def ended_as(self, how: str) -> str:
        """How process 0's attempt ends in the ledger: `how`, unless it saw another process of
        the job go away (`cluster.lost_process`) that did not say it failed on its own
        (`cluster.failed_processes`): then `LOST_PROCESS`, a kill without notice, so that
        the job's next attempts back up between checkpoints as after a kill of process 0."""
        job, name = self.trainer.job, self.trainer.config.job
        if not (job.is_primary and job.processes > 1 and how in (FAILED, CLOSED)):
            return how
        lost, attempt = lost_process(), job.goodput.attempt
        if lost is None or attempt is None or attempt["ended"] is not None:
            return how
        failed = failed_processes()
        if failed:
            who = ", ".join(sorted(failed)).replace("failed/", "process ")
            why = "; ".join(failed.values())[:500]
            logger.warning(
                "job %s: %s failed on its own (%s); this attempt is no kill", name, who, why
            )
            return how
        logger.warning(
            "job %s: another of its %d processes went away (%s): its attempt counts as killed "
            "without notice",
            name,
            job.processes,
            lost,
        )
        return LOST_PROCESS

    def log_goodput(self) -> None:
        """The goodput summary to MLflow (``goodput/*`` metrics at the current step,
        ``goodput.json``)."""
        t = self.trainer
        if t.job.goodput.attempt is not None and t.step is not None:
            t.job.tracker.log_goodput(t.goodput(), t.step)

    def finish(self, status: str) -> None:
        """`Trainer.finish`."""
        t, job = self.trainer, self.trainer.job
        try:
            if status == "FINISHED":
                job.verify_lease()  # a job taken over is not this process's to call finished
                if t.state is not None and not t.recovered:
                    t.train_hooks.at_end(**t.intervals.hook_view())
                t.evaluations.pending.record(wait=True)
            else:
                t.evaluations.pending.record_or_warn()
            if status != "KILLED":  # the eval step's compile too, for the next run's cache
                t.loop.compiling.join()
            # KILLED: SIGTERM's handler waited
            t.flush_compiled(0.0 if status == "KILLED" else END_FLUSH_SECS)
            if job.goodput.attempt is not None:
                job.wait_ended(status)
                how = ENDED_BY_STATUS.get(status, status.lower())
                job.goodput.end(self.ended_as(how))
                self.log_goodput()
            job.finish(status)
            if status == "FINISHED":
                mark_cluster_finished()
            # preempted, its checkpoint committed: its leaving is no loss to the others
            elif status == "KILLED":
                say_goodbye()
        finally:
            t.guard.uninstall()

    def close(self) -> None:
        """`Trainer.close`."""
        t = self.trainer
        try:
            t.evaluations.pending.record_or_warn()
            # (unless it ended already) not a kill, unless a process went away
            t.job.goodput.end(self.ended_as(CLOSED))
            t.loop.compiling.join()
            t.flush_compiled(END_FLUSH_SECS)
            t.job.close()
        finally:
            t.guard.uninstall()
