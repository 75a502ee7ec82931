"""A trainer's checkpoint intervals: train until a checkpoint is due, then save it.

An interval trains the live state from one checkpoint to the next (`CheckpointPolicy` says where
it ends and when a checkpoint or a backup is due), checks the loss on the way, and saves the
step asynchronously with the interval's train metrics. Its time goes to the goodput ledger
(compile, train, checkpoint). This module never imports prefect.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from typing import TYPE_CHECKING

from prefect_jax.training.cluster import any_process, note_failure, process_index
from prefect_jax.training.errors import NonFiniteLossError
from prefect_jax.training.loop import Interval, NonFiniteAt
from prefect_jax.training.names import TRAIN_PREFIX
from prefect_jax.training.progress import notify_progress
from prefect_jax.training.resume_changes import recorded_retention
from prefect_jax.training.resume_checks import DATA_KEY, data_fingerprint_of
from prefect_jax.training.train_means import train_rows

if TYPE_CHECKING:
    from prefect_jax.training.trainer import Trainer

logger = logging.getLogger("prefect_jax.trainer")

Rows = list[tuple[str, float, int]]


class Intervals:
    """The training and saving of one trainer (see `Trainer.train_until_checkpoint`)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.rows_saving: Rows | None = None  # train rows of a save a SIGTERM met (`save`)
        self._compile_accounted = False
        self._push_after_first_step = False  # copy the compile cache after an interval's first step
        self._ahead_s = 0.0  # the last save's time in `_ahead_of_the_end`

    def train_until_checkpoint(self) -> int:
        """`Trainer.train_until_checkpoint`."""
        t = self.trainer
        try:
            t.job.acquire_lease()
            t.guard.install()
            self._push_after_first_step = t.compile_cache is not None
            boundary = t.policy.next_boundary(t.step)
            while True:
                backup_every = (
                    t.policy.backup_every(t.job.goodput, t.config.job) if t.job.is_primary else None
                )
                rows, backup = self._train_part(boundary, backup_every)
                if not backup:
                    break
                self.save(rows, backup=True)
                self.log_train_rows(rows)
                notify_progress(t.step, t.config.train.max_steps, t.last_train_metrics)
            self.save(rows)
            t.train_hooks.at_checkpoint(**self.hook_view())
        except Exception as exc:
            note_failure(exc)  # another process went away: the attempt ends as a kill (`ended_as`)
            raise
        t.push_compiled()
        t.live_is_preemption = False
        self.log_train_rows(rows)
        notify_progress(t.step, t.config.train.max_steps, t.last_train_metrics)
        return t.step

    def _train_part(self, boundary: int, backup_every: float | None) -> tuple[Rows, bool]:
        """Train towards `boundary` until a checkpoint is due: its train metric rows, and whether
        the checkpoint due is a backup (the interval goes on after it). With several JAX
        processes, process 0 (which keeps the ledger) decides on backups (`backup_every`), and
        the others follow."""
        t, job = self.trainer, self.trainer.job
        why: list[str] = []
        if t.step == t.started_from:  # the first training since the restore: the time cadence
            t.policy.saved()  # counts from here (not a first run's MLflow wait, an evaluation)
        part_started = t.policy.clock()
        # This process's first step waits for the train step's compile (or cache load): seconds
        # on a restart that trained nothing a save would keep, so not counted towards either
        # cadence (`compile_s`, its first dispatch included: the first save comes that much later).
        compiles_here = t.loop.compile_s is None
        try:
            with t.guard.deferred() as notice:

                def stop() -> bool:
                    t.evaluations.pending.record_from_loop()
                    # the train step's compile is in the cache, copied while training goes
                    # on (the eval step's, compiled beside the training, with a later push)
                    if self._push_after_first_step:
                        self._push_after_first_step = False
                        t.compile_cache.push_async()
                    # (the save raises it)
                    lost = job.processes == 1 and job.lease.lost_to is not None
                    compile_wait = (t.loop.compile_s or 0.0) if compiles_here else 0.0
                    # (on remote storage, no backup before the last step is up there)
                    due = t.policy.due(
                        part_started,
                        backup_every,
                        notice.requested or lost,
                        job.uploading,
                        compile_wait=compile_wait,
                    )
                    if due is not None:
                        why.append(due)
                    return bool(why)

                started = time.perf_counter()
                try:
                    interval = self._run(boundary, stop, why)
                except NonFiniteAt as bad:
                    job.wait_committed()  # the error names the checkpoint a rerun resumes from
                    # (kept pending if it fails: `finish` or `close` tries again)
                    with contextlib.suppress(Exception):
                        t.evaluations.pending.record(wait=True)
                    raise NonFiniteLossError(
                        bad.step, bad.metrics, job.newest_committed(), t.warm_started
                    ) from None
                t.state, t.step = interval.state, interval.step
                self._account(time.perf_counter() - started)
                rows = self._rows_noting_the_last(interval.logged)
                checkpoint_due = "checkpoint" in why
                if job.processes > 1:
                    # Several processes (one collective per part): a notice any of them got ends
                    # the interval in all of them, at the same step, which all of them checkpoint;
                    # each then ends as if it got the SIGTERM (Crashed in Prefect, rerun as a
                    # whole). They agree on the kind of checkpoint too: a regular one if any of
                    # them wants it, else the backup process 0 asked for.
                    noticed, checkpoint_due = any_process(notice.requested, checkpoint_due)
                    if noticed and not notice.requested:
                        logger.warning(
                            "another process of the job got SIGTERM: ending at step %d with it",
                            t.step,
                        )
                        notice.adopt(signal.SIGTERM)
                if notice.requested:
                    notice.handling = True
                    t.ending.on_sigterm(rows)
        except BaseException:
            t.forget_live_state()
            raise
        # Short of the boundary, the part ended for a backup (in some process) unless a checkpoint
        # is due.
        return rows, not checkpoint_due and t.step < boundary

    def _run(self, boundary: int, stop, why: list[str]) -> Interval:
        """`Loop.run` towards `boundary`, in parts that end at the steps an `every` train hook
        wants (each such step's metrics are logged, for the hook), its hooks called there."""
        t = self.trainer
        hooks = t.train_hooks
        target = hooks.next_step_stop(t.step, boundary)
        if target == boundary:  # (no hook step inside: the one loop, as without hooks)
            interval = t.loop.run(t.state, t.step, t.data_iter, boundary, stop)
            if interval.step == boundary:
                self._at_step(interval)
            return interval
        state, step, logged = t.state, t.step, []
        while True:
            part = t.loop.run(state, step, t.data_iter, target, stop)
            state, step = part.state, part.step
            logged.extend(part.logged)
            if step < target:  # stopped short (by every process together)
                break
            self._at_step(part)
            # (a checkpoint or backup due at the hook's step: one process alone trusts `why`)
            if step >= boundary or (t.job.processes == 1 and why):
                break
            target = hooks.next_step_stop(step, boundary)
        return Interval(state, step, logged)

    def _at_step(self, part: Interval) -> None:
        """The `every` train hooks at the step `part` ended at (its metrics logged there)."""
        hooks = self.trainer.train_hooks
        if not hooks:
            return
        at = [row for row in part.logged if row[0] == part.step]
        metrics = {k: v for k, v, _ in train_rows(at)}
        hooks.at_step(**self.hook_view(state=part.state, step=part.step, metrics=metrics))

    def hook_view(self, **given) -> dict:
        """A `TrainHookView`'s fields at the live step (`given` ones instead)."""
        t = self.trainer
        view = dict(
            step=t.step,
            max_steps=t.config.train.max_steps,
            metrics=dict(t.last_train_metrics),
            state=t.state,
            job=t.config.job,
            process_index=process_index(),
        )
        step = given.get("step", t.step)

        def stop(reason: str) -> None:  # (the flow asks before the next interval: not cached)
            t.job.request_stop(reason, step, by="train hook")
            t.forget_stop_answer()

        return {**view, "stop": stop, **given}

    def _ahead_of_the_end(self) -> None:
        """While the final step's checkpoint commits (the training task waits for it), what the
        job's end asks of the final state: its fingerprint and, where this trainer evaluates its
        live steps (`Evaluations.of_live_steps`), its evaluation. The end then finds them
        (`Loop.memo`) instead of computing them after the commit, as the benchmark's bare loop
        evaluates while its last save commits. The evaluation's time is booked as eval in the
        goodput ledger, the fingerprint's as other, neither as the save's. Not done: with
        several processes (collectives, or process 0's alone), with eval hooks or listeners
        (they may stop or change the evaluation before it starts), once a SIGTERM came (it is
        deferred here: one that comes during the evaluation ends it at its next batch, leaving
        the grace period to the commit). A failure is left to the end, which computes them
        again and reports it."""
        t, began = self.trainer, time.perf_counter()
        if not t.config.train.is_final(t.step) or t.job.processes > 1 or t.guard.requested:
            return
        try:
            t.fingerprint()
            evaluations = t.evaluations
            if t.guard.requested or t.eval_hooks or not evaluations.of_live_steps:
                return
            if evaluations.stopped is not None:  # (an eval listener ended the evaluations)
                return
            t.wait_for_compile_cache()
            with t.job.goodput.phase("eval"):
                state, steps = t.loop.local(t.state), t.config.eval.steps
                t.loop.evaluate_ahead(state, steps, lambda: t.guard.requested)
        except Exception:  # noqa: BLE001 - computed again at the end, which reports it
            logger.debug("the end's work ahead of the final commit failed", exc_info=True)
        finally:
            self._ahead_s = time.perf_counter() - began

    def _account(self, seconds: float) -> None:
        """An interval's time in the goodput ledger: the compile (first in this process), then
        training."""
        compile_s, goodput = self.trainer.loop.compile_s, self.trainer.job.goodput
        if compile_s is not None and not self._compile_accounted:
            self._compile_accounted = True
            goodput.add("compile", compile_s)
            seconds -= compile_s
        goodput.add("train", seconds)

    def _rows_noting_the_last(self, logged) -> Rows:
        """The interval's logged steps as MLflow rows; its last log point's metrics become
        `Trainer.last_train_metrics` (the progress card, the train task's line, hook views)."""
        rows = train_rows(logged)
        if rows:
            last = rows[-1][2]
            self.trainer.last_train_metrics = {k: v for k, v, s in rows if s == last}
        return rows

    def log_train_rows(self, rows) -> None:
        """Train metrics go to MLflow as ``train/<name>`` (eval metrics are
        ``<eval name>/<name>``)."""
        rows = [(k if k.startswith(TRAIN_PREFIX) else TRAIN_PREFIX + k, v, s) for k, v, s in rows]
        self.trainer.job.tracker.log_new_metrics(rows, prefix=TRAIN_PREFIX)

    def save(
        self, train_metrics: Rows = (), preemption: bool = False, backup: bool = False
    ) -> None:
        """Start an asynchronous checkpoint of the live state at the current step.

        MLflow writes are asynchronous, so the interval's train metrics (`train_metrics`), and
        any earlier ones still on their way, go into the checkpoint too: a process killed after
        this step commits but before they reach MLflow has them logged by the rerun that
        restores this step (nothing is logged twice).
        """
        t, job = self.trainer, self.trainer.job
        started = time.perf_counter()
        with t.guard.deferred():  # a SIGTERM now is handled once the save has the step
            # The evaluation of the step before, if its commit has not been seen yet. Its record
            # verified the lease after the commit wait: not read again for this save if that read
            # found it ours within the last second.
            recorded = t.evaluations.pending.record(wait=True)
            t.exports.wait()  # and its export, if in the background (see `Exports.wait`)
            # One writer: a trainer whose job was taken over stops here.
            job.verify_lease(collective=True, max_age=1.0 if recorded is not None else 0.0)
            train_metrics = job.tracker.unwritten_metrics() + list(train_metrics)
            meta = {
                "program": t.config.program,
                "program_fingerprint": t.program_fingerprint,
                "config_fingerprint": t.config.fingerprint(),
                # checked when the job resumes from this step (`program_params.check_restore`)
                "program_params": t.program_params.as_meta(),
                "seed": t.config.train.seed,  # (`resume_checks.check_seed`)
                # what its data was, where the program says (`resume_checks.check_data`)
                **({DATA_KEY: data} if (data := data_fingerprint_of(t.program)) else {}),
                "max_steps": t.config.train.max_steps,  # (an evaluator's is compared with it)
                # a rerun that would delete steps this one keeps says so (`resume_changes`)
                "retention": recorded_retention(t.config.checkpoint),
                # a rerun on this mesh needs no new check of its shardings (`check_sharding`)
                **({"mesh": dict(t.loop.mesh.shape)} if t.loop.sharded else {}),
                # Known unless MLflow is still opening (the first save of a fresh process): then
                # evaluators and reruns find the run by its job tag instead.
                "mlflow_run_id": job.tracker.run_id_if_known(),
                "train_metrics": [list(r) for r in train_metrics],
                # (a step between log points: the sums of the log point's mean, for the rerun)
                **({"train_sums": sums} if (sums := t.loop.means.carried_sums(t.step)) else {}),
                "preemption": preemption
                or backup,  # off the cadence: resumed from, never evaluated
                # written because attempts of the job were killed
                **({"backup": True} if backup else {}),
            }
            # first: a save killed part-way leaves its steps counted as lost
            job.goodput.trained_to(t.step)
            self._ahead_s, saving = 0.0, time.perf_counter()
            try:
                ahead = None if preemption or backup else self._ahead_of_the_end
                job.save(t.step, t.state, t.data_iter, meta, while_committing=ahead)
            finally:  # (the end's work ahead of the final commit is not the save's cost)
                job.goodput.add("checkpoint", time.perf_counter() - saving - self._ahead_s)
            t.policy.saved()
            job.goodput.saved(time.perf_counter() - started - self._ahead_s)
        if t.config.train.is_final(t.step) and not (preemption or backup):
            uploading = time.perf_counter()
            job.wait_uploaded(until=lambda: t.guard.requested)  # (outside: a SIGTERM is heard)
            job.goodput.add("checkpoint", time.perf_counter() - uploading)
        self.rows_saving = train_metrics  # a SIGTERM handled now logs them once the step commits
        try:
            t.guard.handle_if_pending()
        finally:
            self.rows_saving = None
