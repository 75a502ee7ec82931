"""The engine's four verbs over one job: restore-or-init, train to the next checkpoint,
evaluate, export.

A `Trainer` puts a `Job` (what lives in storage: checkpoints, eval records, exports, lease,
MLflow run) together with a `Loop` (compiled steps, input iterator, NaN guard), and holds the
job's live train state in this process between checkpoint intervals, so an interval does not
re-read the checkpoint it just wrote. A retry, a rerun or another process restores from
storage. This module never imports prefect: call it from a notebook.

Example:
    ```python
    from prefect_jax.training import JobConfig, TrainSpec, CheckpointSpec, Trainer

    config = JobConfig(program="prefect_jax.examples.digits:program", job="digits",
                       storage="/tmp/runs", train=TrainSpec(max_steps=600),
                       checkpoint=CheckpointSpec(every_steps=200))
    trainer = Trainer(config)
    trainer.restore_or_init()
    while trainer.step < config.train.max_steps:
        trainer.train_until_checkpoint()
        print(trainer.evaluate_if_new().metrics)
    trainer.close()
    ```
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Any, Callable

from prefect_jax.training import control
from prefect_jax.training import exporters as exp
from prefect_jax.training.checkpoints import CorruptCheckpointError, state_fingerprint
from prefect_jax.training.cluster import LostProcess, any_process, failed_processes, forget_lost, from_primary, lost_process, note_failure
from prefect_jax.training.cluster import initialize as initialize_cluster
from prefect_jax.training.cluster import mark_finished as mark_cluster_finished
from prefect_jax.training.cluster import say_goodbye
from prefect_jax.training.errors import LeaseLostError, NonFiniteLossError, PastMaxStepsError, Preempted
from prefect_jax.training.evaluation import EvalResult, EvalStatus, throttled
from prefect_jax.training.goodput import LOST_PROCESS
from prefect_jax.training.job import Job
from prefect_jax.training.lease import duplicate_wait_ended
from prefect_jax.training.compile_cache import END_FLUSH_SECS, open_compilation_cache
from prefect_jax.training.loop import Loop, NonFiniteAt, add_progress_listener, notify_progress
from prefect_jax.training.policy import CheckpointPolicy
from prefect_jax.training.preemption import PreemptionGuard
from prefect_jax.training.program import ProgramError, has_serving, load_program, program_fingerprint
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.registry import alias_for
from prefect_jax.training.session import restore_or_init
from prefect_jax.training.specs import BestExporter, JobConfig
from prefect_jax.training.tracking import flatten_params

TRAIN_PREFIX = "train/"
logger = logging.getLogger("prefect_jax.trainer")

__all__ = ["Trainer", "add_progress_listener", "restore_or_init"]


DEVICES_TAG = "prefect_jax.devices"  # the MLflow run's: what its newest training attempt runs on
# How long a "no stop" answer stands at the same live step (`Trainer.stop_requested`): the flow's
# ask and its train task's, moments apart; not a task retry (2 s on), nor anyone polling.
STOP_ANSWER_SECS = 1.0


def describe_devices() -> str:
    """``"1 x NVIDIA H100 80GB HBM3 (gpu)"``, ``"16 x TPU v5 lite (tpu), 4 processes"``."""
    import jax

    devices = jax.devices()
    text = f"{len(devices)} x {', '.join(sorted({d.device_kind for d in devices}))} ({jax.default_backend()})"
    return text + (f", {jax.process_count()} processes" if jax.process_count() > 1 else "")


class Trainer:
    """One job's live training session.

    Args:
        config: the job.
        program: the program object (loaded from ``config.program`` when None).
        run_tags: extra metadata stored in checkpoints and MLflow tags (e.g. the Prefect
            flow-run id, which also names the owner of the job's lease).
    """

    def __init__(self, config: JobConfig, program: Any = None, run_tags: dict[str, str] | None = None):
        initialize_cluster()  # several JAX processes (from the environment): joined before JAX picks its devices
        forget_lost()  # (a lost process seen by an earlier trainer in this process is not this one's)
        self.config = config
        self.program = program if program is not None else load_program(config.program)
        self.job = Job(config, run_tags)
        try:
            self._compile_cache = None  # a mirror of a cache on remote storage (see compile_cache)
            if config.compilation_cache_dir:
                self._compile_cache = open_compilation_cache(config.compilation_cache_dir, self.job.storage, push=self.job.is_primary)
            self.program_fingerprint = program_fingerprint(config.program, self.program)
            if config.eval.exporters and not has_serving(self.program):
                raise ProgramError(
                    f"exporters {[e.name for e in config.eval.exporters]} are configured, but program "
                    f"{config.program!r} has no serve(state, inputs) and serving_input(): add them, or drop the exporters"
                )
            self.loop = Loop(self.program, config.train)
            if config.eval.exporters and config.eval.export_platforms:  # named ones: refused now, not an interval in
                exp.check_serving_platforms(self.program, self.loop.abstract_state, config.eval.export_platforms)
        except BaseException:
            try:
                self.job.close()  # its lease (a flow run's restore task took it early), its MLflow worker
            except Exception:  # noqa: BLE001 - the refusal above is what the caller must see
                logger.warning("could not close job %s after its trainer was refused", config.job, exc_info=True)
            raise
        self.state = None
        self.step: int | None = None
        self.data_iter = None
        self.last_train_metrics: dict[str, float] = {}
        self._started_from: int | None = None  # the step the live state was restored (or initialised) at
        self._no_stop_at: tuple[int, float] | None = None  # (live step, monotonic time) of the last "no stop" read
        self._last_save = time.monotonic()
        self._evals_reconciled = False
        self._example = None  # the serving input example (see _serving_example)
        self._live_is_preemption = False  # the live step was restored from a preemption checkpoint
        self._rows_saving: list[tuple[str, float, int]] | None = None  # train rows of a save a SIGTERM met (`save`)
        # An evaluation of the live step whose save was in flight, and what to call once it is
        # recorded: recorded when the step commits, while training goes on (`_evaluate_if_new`).
        self._pending: tuple[EvalResult, Callable[[EvalResult], None] | None] | None = None
        self._record_from_loop = True  # off after a failed try there: the next save records it, or raises
        self._compile_accounted = False
        self._push_after_first_step = False  # copy the compile cache after an interval's first step (`_train_part`)
        self._guard = PreemptionGuard(self._end_on_sigterm)
        self._preempted: tuple | None = None  # (step, committed, signal) of the notice handled, once forwarded
        self.eval_hooks = control.load_hooks(config.eval.hooks)
        es = config.eval.early_stopping
        self.early_stopping = (
            control.EarlyStoppingHook(es.metric, es.mode, es.max_steps_without_improvement, es.min_delta) if es else None
        )

    # The job's parts, by their old names.
    storage = property(lambda self: self.job.storage)
    checkpoints = property(lambda self: self.job.checkpoints)
    records = property(lambda self: self.job.records)
    tracker = property(lambda self: self.job.tracker)
    lease = property(lambda self: self.job.lease)
    remote = property(lambda self: self.job.remote)
    run_tags = property(lambda self: self.job.run_tags)
    commit_listeners = property(lambda self: self.job.commit_listeners)
    abstract_state = property(lambda self: self.loop.abstract_state)

    def committed_steps(self) -> list[int]:
        return self.job.committed_steps()

    def stop_requested(self) -> dict | None:
        """The job's durable stop request, if any. With several processes, process 0's answer in
        every process (a collective: they all call it at the same point, and agree whether to go on).

        With one process, asked again at the same live step within `STOP_ANSWER_SECS` (the flow
        asks before each train task, and the task at its start), a "no stop" answer stands: no
        second read of the job's storage (a GET on object storage). A request made in between is
        seen at the next ask; one that this trainer's evaluation makes (early stopping), at once."""
        if self.job.processes == 1:
            last = self._no_stop_at
            if last is not None and last[0] == self.step and time.monotonic() - last[1] < STOP_ANSWER_SECS:
                return None
            stop = self.job.stop_requested()
            self._no_stop_at = (self.step, time.monotonic()) if stop is None and self.step is not None else None
            return stop
        stop = self.job.stop_requested() if self.job.is_primary else None
        if not from_primary(stop is not None):
            return None
        return stop or self.job.stop_requested() or {"reason": "stop requested (see process 0)"}

    # -- restore ---------------------------------------------------------------------

    def restore_or_init(
        self,
        checkpoint_path: str | None = None,
        wait_for_checkpoint: bool = False,
        max_wait_secs: float = 7200,
        recovery_wait_secs: float = 30,
    ) -> int:
        """Take the job's lease, then resume from its latest readable committed step; else from
        `checkpoint_path`; else init.

        Torn steps (never committed) and unreadable or corrupt ones are moved aside with a
        warning naming the step. Also finds (or creates) the job's MLflow run. Returns the step
        the state is at.

        Raises:
            LeaseHeldError: another live trainer holds the job.
        """
        try:
            return self._restore_or_init(checkpoint_path, wait_for_checkpoint, max_wait_secs, recovery_wait_secs)
        except Exception as exc:
            note_failure(exc)  # several processes: a peer lost in the collective restore, or this one's own failure
            raise

    def _restore_or_init(self, checkpoint_path, wait_for_checkpoint, max_wait_secs, recovery_wait_secs) -> int:
        self._stop_if_preempted()
        self._no_stop_at = None  # (a restore may land on the step last asked at: ask again)
        job, loop = self.job, self.loop
        job.goodput.restore_began()
        job.checkpoints.wait()
        newest, max_steps = job.newest_committed(), self.config.train.max_steps
        if newest is not None and newest > max_steps:
            raise PastMaxStepsError(redact_url(job.storage.job_dir), newest, max_steps)
        job.acquire_lease()
        waited = duplicate_wait_ended(job.storage.job_dir)
        if waited is not None:  # another process of this flow run trained until then: not this attempt's time
            job.goodput.restart_clock(waited)
        self._guard.install()
        self._wait_for_compile_cache()
        loop.start_precompile()
        listed = job.prepare_restore()  # (remote: the committed steps, listed once for the restore below)
        has_own = bool(listed if listed is not None else job.committed_steps())
        state, step, meta, data_iter = restore_or_init(
            job.checkpoints,
            loop.init_state,
            loop.abstract_state,
            checkpoint_dir=job.checkpoints.directory if (has_own or not checkpoint_path) else None,
            checkpoint_path=None if has_own else checkpoint_path,
            make_data_iter=loop.fresh_iter,
            wait_for_checkpoint=wait_for_checkpoint,
            max_wait_secs=max_wait_secs,
            recovery_wait_secs=recovery_wait_secs,
            on_unreadable=job.set_aside,
            list_steps=(lambda: listed) if listed else job.committed_steps,  # (none yet: a wait for one lists again)
            prepare_step=job.fetch if job.remote is not None else None,
        )
        if checkpoint_path and not has_own and step:
            data_iter = loop.fresh_iter()  # warm start: weights from elsewhere, this job's data from the start
        job.discard_records_after(step)
        # Attach to MLflow first, so that a refusal below still closes the run as FAILED.
        job.attach_tracking(self._params(), (meta or {}).get("mlflow_run_id"))
        # The restored interval's train metrics, in case its process died before writing them.
        self._log_train_rows([tuple(r) for r in (meta or {}).get("train_metrics", [])])
        if step < self.config.train.max_steps:
            job.record_attempt(step)
            if job.is_primary:  # what this attempt trains on, for the MLflow run's reader
                self.tracker.set_tags({DEVICES_TAG: describe_devices()})
        self.state, self.step, self.data_iter = loop.place(state), step, data_iter
        self._live_is_preemption = bool((meta or {}).get("preemption"))
        self._started_from = step  # committed, or init / a warm start: a rerun gets the same state
        self._last_save = time.monotonic()
        job.goodput.begin(step)
        notify_progress(step, self.config.train.max_steps, {})
        return step

    def _params(self) -> dict[str, str]:
        c = self.config
        return flatten_params(
            "",
            {
                "program": c.program,
                "job": c.job,
                "train": c.train.model_dump(mode="json"),
                "eval": c.eval.model_dump(mode="json"),
                "checkpoint": c.checkpoint.model_dump(mode="json"),
                "program_config": getattr(self.program, "config", None) or {},
            },
        )

    # -- train -----------------------------------------------------------------------

    def next_boundary(self) -> int:
        """The next step at which a checkpoint is due by step cadence (or max_steps)."""
        every = self.config.checkpoint.every_steps
        max_steps = self.config.train.max_steps
        if every is None:
            return max_steps
        return min(max_steps, (self.step // every + 1) * every)

    def train_until_checkpoint(self) -> int:
        """Train until the next checkpoint is due, save it asynchronously, return the step reached.

        Training metrics stay on the device during the interval and go to MLflow in one batch
        at its end. A NaN/Inf loss is looked for every `log_every_steps` and before the save;
        it raises `NonFiniteLossError` naming the step and nothing of it is checkpointed.
        On SIGTERM the step in flight finishes, is checkpointed within `sigterm_grace_secs`,
        and the signal goes on to the previous handler (see `PreemptionGuard`).
        Once attempts of the job were killed without notice, backups (resume-only checkpoints,
        `CheckpointSpec.backups`) are written within the interval, which goes on after each.
        """
        self._require_live()
        try:
            self.job.acquire_lease()
            self._guard.install()
            self._push_after_first_step = self._compile_cache is not None
            boundary = self.next_boundary()
            while True:
                rows, backup = self._train_part(boundary, self._backup_every())
                if not backup:
                    break
                self.save(rows, backup=True)
                self._log_train_rows(rows)
                notify_progress(self.step, self.config.train.max_steps, self.last_train_metrics)
            self.save(rows)
        except Exception as exc:
            note_failure(exc)  # another process went away: the attempt ends as a kill (`_ended_as`)
            raise
        self._push_compiled()
        self._live_is_preemption = False
        self._log_train_rows(rows)
        notify_progress(self.step, self.config.train.max_steps, self.last_train_metrics)
        return self.step

    def _train_part(self, boundary: int, backup_every: float | None) -> tuple[list[tuple[str, float, int]], bool]:
        """Train towards `boundary` until a checkpoint is due: its train metric rows, and whether
        the checkpoint due is a backup (the interval goes on after it). A backup is due
        `backup_every` seconds into the part (not counting the evaluation, export or task runs
        before it: they trained nothing a backup would keep)."""
        every_secs = self.config.checkpoint.every_secs
        why: list[str] = []
        part_started = time.monotonic()
        try:
            with self._guard.deferred() as notice:

                def stop() -> bool:
                    if self._pending is not None and self._record_from_loop:
                        self._record_pending_if_landed(inside="train")
                    if self._push_after_first_step:  # its compile is in the cache, copied while training goes on
                        self._push_after_first_step = False
                        self._compile_cache.push_async()
                    now = time.monotonic()
                    lost = self.job.processes == 1 and self.lease.lost_to is not None  # (the save raises it)
                    if notice.requested or lost or (every_secs is not None and now - self._last_save >= every_secs):
                        why.append("checkpoint")
                    elif backup_every is not None and now - part_started >= backup_every and not self.job.uploading():
                        why.append("backup")  # (on remote storage, not before the last step is up there)
                    return bool(why)

                started = time.perf_counter()
                try:
                    interval = self.loop.run(self.state, self.step, self.data_iter, boundary, stop)
                except NonFiniteAt as bad:
                    self.job.wait_committed()  # the error names the checkpoint a rerun resumes from
                    with contextlib.suppress(Exception):  # (kept pending if it fails: `finish` or `close` tries again)
                        self._record_pending(wait=True)
                    raise NonFiniteLossError(bad.step, bad.metrics, self.job.newest_committed()) from None
                self.state, self.step = interval.state, interval.step
                self._account_interval(time.perf_counter() - started)
                rows = self._train_rows(interval.logged)
                checkpoint_due = "checkpoint" in why
                if self.job.processes > 1:
                    # Several processes (one collective per part): a notice any of them got ends
                    # the interval in all of them, at the same step, which all of them checkpoint;
                    # each then ends as if it got the SIGTERM (Crashed in Prefect, rerun as a
                    # whole). They agree on the kind of checkpoint too: a regular one if any of
                    # them wants it, else the backup process 0 asked for.
                    noticed, checkpoint_due = any_process(notice.requested, checkpoint_due)
                    if noticed and not notice.requested:
                        logger.warning("another process of the job got SIGTERM: ending at step %d with it", self.step)
                        notice.adopt(signal.SIGTERM)
                if notice.requested:
                    notice.handling = True
                    self._end_on_sigterm(rows)
        except BaseException:
            self._forget_live_state()
            raise
        # Short of the boundary, the part ended for a backup (in some process) unless a checkpoint is due.
        return rows, not checkpoint_due and self.step < boundary

    def _backup_every(self) -> float | None:
        """Seconds between backups for this job now (`CheckpointPolicy.backup_every`), or None.
        With several processes, process 0 (which keeps the ledger) asks, and the others follow."""
        if not self.job.is_primary:
            return None
        return CheckpointPolicy.from_spec(self.config.checkpoint).backup_every(self.job.goodput, self.config.job)

    def _ended_as(self, how: str) -> str:
        """How process 0's attempt ends in the ledger: `how`, unless it saw another process of
        the job go away (`cluster.lost_process`) that did not say it failed on its own
        (`cluster.failed_processes`): then `goodput.LOST_PROCESS`, a kill without notice, so that
        the job's next attempts back up between checkpoints as after a kill of process 0."""
        if not (self.job.is_primary and self.job.processes > 1 and how in ("failed", "closed")):
            return how
        lost, attempt = lost_process(), self.job.goodput.attempt
        if lost is None or attempt is None or attempt["ended"] is not None:
            return how
        failed = failed_processes()
        if failed:
            logger.warning("job %s: %s failed on its own (%s); this attempt is no kill", self.config.job,
                           ", ".join(sorted(failed)).replace("failed/", "process "), "; ".join(failed.values())[:500])  # fmt: skip
            return how
        logger.warning("job %s: another of its %d processes went away (%s): its attempt counts as killed without notice",
                       self.config.job, self.job.processes, lost)  # fmt: skip
        return LOST_PROCESS

    def _account_interval(self, seconds: float) -> None:
        """An interval's time in the goodput ledger: the compile (first in this process), then training."""
        compile_s, goodput = self.loop.compile_s, self.job.goodput
        if compile_s is not None and not self._compile_accounted:
            self._compile_accounted = True
            goodput.add("compile", compile_s)
            seconds -= compile_s
        goodput.add("train", seconds)

    def _train_rows(self, logged) -> list[tuple[str, float, int]]:
        rows = self.loop.train_rows(logged)
        if rows:
            last = rows[-1][2]
            self.last_train_metrics = {k: v for k, v, s in rows if s == last}
        return rows

    def _log_train_rows(self, rows) -> None:
        """Train metrics go to MLflow as ``train/<name>`` (eval metrics are ``<eval name>/<name>``)."""
        rows = [(k if k.startswith(TRAIN_PREFIX) else TRAIN_PREFIX + k, v, s) for k, v, s in rows]
        self.tracker.log_new_metrics(rows, prefix=TRAIN_PREFIX)

    def save(self, train_metrics: list[tuple[str, float, int]] = (), preemption: bool = False, backup: bool = False) -> None:
        """Start an asynchronous checkpoint of the live state at the current step.

        MLflow writes are asynchronous, so the interval's train metrics (`train_metrics`), and
        any earlier ones still on their way, go into the checkpoint too: a process killed after
        this step commits but before they reach MLflow has them logged by the rerun that
        restores this step (nothing is logged twice).
        """
        started = time.perf_counter()
        with self._guard.deferred():  # a SIGTERM now is handled once Orbax has the step
            # The evaluation of the step before, if its commit has not been seen yet. Its record
            # verified the lease after the commit wait: not read again for this save if that read
            # found it ours within the last second.
            recorded = self._record_pending(wait=True)
            # One writer: a trainer whose job was taken over stops here.
            self.job.verify_lease(collective=True, max_age=1.0 if recorded is not None else 0.0)
            train_metrics = self.tracker.unwritten_metrics() + list(train_metrics)
            meta = {
                "program": self.config.program,
                "program_fingerprint": self.program_fingerprint,
                "config_fingerprint": self.config.fingerprint(),
                # Known unless MLflow is still opening (the first save of a fresh process): then
                # evaluators and reruns find the run by its job tag instead.
                "mlflow_run_id": self.tracker.run_id_if_known(),
                "train_metrics": [list(r) for r in train_metrics],
                "preemption": preemption or backup,  # off the cadence: resumed from, never evaluated
                **({"backup": True} if backup else {}),  # written because attempts of the job were killed
            }
            self.job.goodput.trained_to(self.step)  # first: a save killed part-way leaves its steps counted as lost
            with self.job.goodput.phase("checkpoint"):
                self.job.save(self.step, self.state, self.data_iter, meta)
            self._last_save = time.monotonic()
            self.job.goodput.saved(time.perf_counter() - started)
        self._rows_saving = train_metrics  # a SIGTERM handled now logs them once the step commits
        try:
            self._guard.handle_if_pending()
        finally:
            self._rows_saving = None

    def _end_on_sigterm(self, rows: list[tuple[str, float, int]] | None = None) -> None:
        """A preemption notice: checkpoint the live step (in the loop, `rows` are its interval's
        train metrics) or let its save in flight commit (anywhere else: during an evaluation, an
        export, between tasks), within `sigterm_grace_secs`; say which step is the newest
        committed one; close the MLflow run KILLED, free the lease, forward the signal."""
        grace, started = self.config.train.sigterm_grace_secs, time.monotonic()
        saved_rows = rows if rows is not None else self._rows_saving  # (None: no save just ended here)
        committed = False
        try:
            if rows is not None and self._pending is not None:
                try:
                    self._record_pending(wait=True)
                except Exception as exc:  # noqa: BLE001 - then no newer step: the rerun resumes from that one and evaluates it
                    logger.warning("SIGTERM at step %d: the evaluation of step %d could not be recorded (%r): not checkpointing "
                                   "step %d", self.step, self._pending[0].step, exc, self.step)  # fmt: skip
                    self._pending, rows, saved_rows = None, None, None
            if rows is not None:
                logger.warning("SIGTERM at step %d: checkpointing it (grace %.0fs)", self.step, grace)
                every, max_steps = self.config.checkpoint.every_steps, self.config.train.max_steps
                self.save(rows, preemption=self.step < max_steps and not (every and self.step % every == 0))  # checks the lease
            else:
                with contextlib.suppress(LeaseLostError):  # taken over: the job's records below are not this process's to write
                    self.job.verify_lease()
                logger.warning("SIGTERM at step %s (between checkpoints): letting its checkpoint commit (grace %.0fs)", self.step, grace)
            committed = _within(self.job.wait_committed, grace) and self.step is not None and self.job.is_committed(self.step)
            if self._pending is not None:  # an evaluation whose step was committing: recorded if it did, before the run closes
                self._record_pending_if_landed()
                self._pending = None  # (else the rerun evaluates that step)
            if self._compile_cache is not None:  # what this attempt compiled, for the rerun (on another node)
                self._compile_cache.flush(min(10.0, max(0.0, grace - (time.monotonic() - started))))
            if committed:
                logger.warning("step %d committed in %.2fs after SIGTERM", self.step, time.monotonic() - started)
                if saved_rows:  # the interval's train metrics (the checkpoint has them too, for a rerun)
                    self._log_train_rows(saved_rows)
            else:
                logger.error("the checkpoint of step %s did not commit within %.0fs: abandoned; step %s stays the newest valid one",
                             self.step, grace, self.job.newest_committed())  # fmt: skip
            self.job.goodput.end("preempted")
            self._log_goodput()
            # MLflow may be slow (or its thread busy): never much past the grace period.
            _within(lambda: self.tracker.finish("KILLED"), max(1.0, grace - (time.monotonic() - started)))
            self.lease.release()
        finally:
            # Whatever failed above (storage going away with the node, say), the notice goes on:
            # else the guard, handling it still, would take no later SIGTERM either.
            with contextlib.suppress(Exception):
                self.lease.release()  # (returns at once once released)
            self._preempted = (self.step, committed, self._guard.signum)
            self._forget_live_state()
            self._guard.forward()
        raise Preempted(*self._preempted)

    def _stop_if_preempted(self) -> None:
        """Raise `Preempted` if this trainer handled a notice: where the handler it went on to
        raised in a place that dropped that (a gc callback: `deliver_lost_notices` sends the signal
        again, a moment later), nothing more of the job is done meanwhile."""
        if self._preempted is not None:
            raise Preempted(*self._preempted)

    def _wait_for_compile_cache(self) -> None:
        """Before compiling: let the entries of a cache on remote storage arrive (pulled since
        the trainer was made, overlapping its set-up)."""
        if self._compile_cache is not None:
            self._compile_cache.wait_pulled()

    def _push_compiled(self) -> None:
        """Copy new compilation cache entries to storage in the background. A SIGTERM meanwhile is
        handled once the entries are listed: its handler flushes the same cache."""
        if self._compile_cache is not None:
            with self._guard.deferred():
                self._compile_cache.push_async()
            self._guard.handle_if_pending()

    def _flush_compiled(self, timeout: float) -> None:
        """`_push_compiled`, then wait up to `timeout` seconds for the copies."""
        if self._compile_cache is not None:
            self._push_compiled()
            self._compile_cache.wait(timeout)

    def _require_live(self):
        self._stop_if_preempted()
        if self.state is None:
            raise RuntimeError("no live state: call restore_or_init() first")

    def _forget_live_state(self) -> None:
        """The live state is somewhere inside an interval (its buffers may have been donated):
        drop it, so the next attempt restores the last committed checkpoint."""
        self.state = self.step = self.data_iter = None

    # -- evaluate --------------------------------------------------------------------

    def evaluate_if_new(
        self, step: int | None = None, force: bool = False, on_recorded: Callable[[EvalResult], None] | None = None
    ) -> EvalResult:
        """Evaluate `step` (default: the live step, else the newest committed one) unless done before.

        Returns an EvalResult with status EVALUATED (metrics logged to MLflow and recorded
        durably), NO_NEW_CHECKPOINT (already evaluated), MISSING_CHECKPOINT (nothing to
        evaluate) or THROTTLED (evaluated less than `throttle_secs` ago; `force` overrides).

        A step is recorded only once its checkpoint has committed. The live step's save is
        usually still in flight here: then the result is EVALUATED with ``pending_commit``, and
        it is recorded once the step commits, by the training that goes on meanwhile (or by the
        next save, evaluation, export or `finish`), so that training does not wait for the commit.
        Where something decides on the result before training goes on (early stopping, eval
        hooks, the final step) or the job has several processes, this waits for the commit and
        records the step before it returns. `on_recorded(result)` is called once the result is
        recorded, now or later (never if the step does not commit).
        """
        with self.job.goodput.phase("eval"):  # a trainer's own evaluations (an evaluator keeps no ledger)
            result = self._evaluate_if_new(step, force, on_recorded)
        if result.status == EvalStatus.EVALUATED:
            self._push_compiled()
        return result

    def _evaluate_if_new(self, step: int | None, force: bool, on_recorded) -> EvalResult:
        self._stop_if_preempted()
        spec = self.config.eval
        self._record_pending(wait=True, inside="eval")
        if not self.job.is_primary:  # process 0 evaluates its replica; the others go on training
            return EvalResult(status=EvalStatus.OTHER_PROCESS, name=spec.name, step=step)
        if self.lease.held:  # the trainer evaluating its own steps (local mode)
            self._guard.install()
        if step is None:
            step = self.step if self.state is not None else self.job.newest_committed()
        live = self.state is not None and self.step == step
        missing = EvalResult(status=EvalStatus.MISSING_CHECKPOINT, name=spec.name, step=step)
        if step is None or (not live and not self.job.is_committed(step)):
            return missing
        if not self._evals_reconciled:
            self.reconcile_eval_metrics(step)
        # The live step's save still in flight: no record of it can exist (a step is recorded, by
        # this trainer or an evaluator, once it is committed; a rerun moved aside the records past
        # the step it resumed from), so none is read (a round trip on object storage).
        in_flight = live and step != self._started_from and self.job.processes == 1 and not self.job.save_landed()
        done = None if in_flight else self.records.get(step)
        if done is not None:
            return done.model_copy(update={"status": EvalStatus.NO_NEW_CHECKPOINT})
        is_final = step >= self.config.train.max_steps
        if not is_final and self._is_preemption_checkpoint(step, live):
            logger.info("step %d is a preemption checkpoint (off the every_steps cadence): kept to resume from, not evaluated", step)
            return EvalResult(status=EvalStatus.PREEMPTION_CHECKPOINT, name=spec.name, step=step)
        if not (force or is_final) and throttled(self.records, spec.throttle_secs):
            return EvalResult(status=EvalStatus.THROTTLED, name=spec.name, step=step)
        for hook in self.eval_hooks:
            before = getattr(hook, "before_eval", None)
            if before is not None and before(step) is False:
                return EvalResult(status=EvalStatus.THROTTLED, name=spec.name, step=step)
        try:
            state = self._state_at(step)
        except CorruptCheckpointError as exc:
            logger.error("not evaluating step %d: %s", step, exc)
            return missing
        self._wait_for_compile_cache()
        metrics, n, examples = self.loop.evaluate(state, spec.steps)
        result = EvalResult(
            status=EvalStatus.EVALUATED, name=spec.name, step=step, metrics=metrics, num_batches=n,
            num_examples=examples, evaluated_at=time.time(), is_final=is_final,
        )  # fmt: skip
        # The live step's save may still be in flight (the evaluation overlapped it): a step is
        # recorded, logged and exported only once it is committed, so that a crash before the
        # commit leaves nothing that says it was evaluated (the rerun evaluates it again). (Asked
        # only where it may wait: with several processes Orbax's flag is behind their barriers.)
        if live and step != self._started_from and self._may_record_later(is_final) and not self.job.save_landed():
            pending = result.model_copy(update={"pending_commit": True})
            self._pending, self._record_from_loop = (pending, on_recorded), True
            return pending
        if live and not self._committed(step):
            logger.error("step %d did not commit: its evaluation is not recorded", step)
            return missing
        return self._record(result, on_recorded)

    def _may_record_later(self, is_final: bool) -> bool:
        """Whether an evaluation of the live step may be recorded once its step commits, training
        going on meanwhile: not when something decides on it first (early stopping, eval hooks:
        a stop they ask for ends the job at this step), at the final step, or with several
        processes (their commit is collective)."""
        return not is_final and self.early_stopping is None and not self.eval_hooks and self.job.processes == 1

    def _record_pending_if_landed(self, inside: str | None = None) -> None:
        """From the training loop (or a SIGTERM's end): record the pending evaluation if its save
        has landed; a failure is retried by the next save, which waits for it. The record is
        evaluation time in the goodput ledger (not time of `inside`, the phase this runs in)."""
        if self._pending is None or not self.job.save_landed():
            return
        step = self._pending[0].step
        try:
            with self._phase_within("eval", inside):
                self._record_pending(wait=False)
        except Exception as exc:  # noqa: BLE001 - not the training's to end: the next save records it, or raises
            self._record_from_loop = False
            logger.warning("could not record the evaluation of step %d yet (the next save tries again): %r", step, exc)

    def _record_pending(self, wait: bool, inside: str | None = None) -> EvalResult | None:
        """Record the pending evaluation (see `evaluate_if_new`) if its step committed (`wait`:
        once the saves in flight have landed; `inside`: the goodput phase this runs in); the
        recorded result, or None (nothing pending, or its step did not commit)."""
        if self._pending is None:
            return None
        result, on_recorded = self._pending
        if wait:
            self._wait_committed(inside)
        if not self.job.is_committed(result.step):
            self._pending = None
            logger.error("step %d did not commit: its evaluation is not recorded", result.step)
            return None
        self._pending = None  # (off first: a SIGTERM handled while this records finds nothing pending)
        try:
            return self._record(result.model_copy(update={"pending_commit": False}), on_recorded)
        except Exception:
            self._pending = (result, on_recorded)  # retried (records and MLflow logs are idempotent)
            raise

    def _record_pending_or_warn(self) -> None:
        """At the end of a trainer (one that did not finish): the pending evaluation recorded if
        its step commits; if that fails, the rerun evaluates the step."""
        if self._pending is None:
            return
        try:
            self._record_pending(wait=True)
        except Exception as exc:  # noqa: BLE001 - ending anyway: what stops the record is not to hide why it ends
            logger.warning("the evaluation of step %d was not recorded (the rerun evaluates it): %r", self._pending[0].step, exc)
            self._pending = None

    def _record(self, result: EvalResult, on_recorded) -> EvalResult:
        """Log an evaluation of a committed step to MLflow, record it durably, ask for a stop if
        its hooks say so; then `on_recorded(result)`."""
        step, spec, metrics, is_final = result.step, self.config.eval, result.metrics, result.is_final
        self.job.verify_lease()  # a trainer whose job was taken over records nothing more
        # Unless a crash came between this log and the record below, in an earlier attempt.
        self._log_eval(result)
        self.records.put(result)
        train_key = TRAIN_PREFIX + ("loss" if "loss" in self.last_train_metrics else next(iter(self.last_train_metrics), "loss"))
        self.tracker.log_learning_curve(step, train_key, [f"{spec.name}/{k}" for k in sorted(metrics)],
                                        min_interval_secs=0.0 if is_final else spec.learning_curve_every_secs)  # fmt: skip
        reason = control.after_eval_stop_reason(result, self.records, self.early_stopping, self.eval_hooks)
        if reason:
            logger.warning("%s: asking job %s to stop", reason, self.config.job)
            self.job.request_stop(reason, step, by=f"eval {spec.name}")
            self._no_stop_at = None
            self.tracker.set_tags({"prefect_jax.stop_reason": reason[:5000]})
            result = result.model_copy(update={"stop_reason": reason})
        if on_recorded is not None:
            try:
                on_recorded(result)
            except Exception:  # noqa: BLE001 - the record stands; what the caller publishes is best effort
                logger.exception("after recording the evaluation of step %d", step)
        return result

    def _is_preemption_checkpoint(self, step: int, live: bool) -> bool:
        if live:
            return self._live_is_preemption
        try:
            return bool(self.job.read_meta(step).get("preemption"))
        except Exception:  # noqa: BLE001 - unreadable metadata: the evaluation says what is wrong
            return False

    def _state_at(self, step: int):
        """The state at `step` in this process alone: the live one (this process's replica), or restored."""
        if self.state is not None and self.step == step:
            return self.loop.local(self.state)
        if self.job.processes > 1:  # Orbax's restore is collective: one process alone would wait forever
            raise ValueError(
                f"step {step} is not the live step ({self.step}): with {self.job.processes} JAX processes, process 0 "
                "evaluates and exports the live step only; evaluate older steps with the evaluate flow, in its own process"
            )
        return self.job.restore(step, self.abstract_state)[0]

    def _committed(self, step: int) -> bool:
        """Whether `step` counts, once the saves in flight have landed (waits for them). The state
        training started from counts too: committed, or made by init (or a warm start), which a
        rerun makes again, bit for bit."""
        if step == self._started_from:
            return True
        if step == self.step:
            try:
                self._wait_committed(inside="eval")
            except LostProcess:  # another process went away after its part of the commit: process 0's is final
                if not self.job.is_committed(step):
                    raise
                logger.warning("step %d is committed (another process went away after it: %s)", step, lost_process())
        return self.job.is_committed(step)

    def _wait_committed(self, inside: str | None = None) -> None:
        """Wait for the saves in flight, as checkpoint time in the goodput ledger (not as time of
        `inside`, the phase this runs in)."""
        with self._phase_within("checkpoint", inside):
            self.job.wait_committed()

    @contextlib.contextmanager
    def _phase_within(self, phase: str, inside: str | None):
        """Time spent in the block is `phase` time in the goodput ledger, taken off `inside` (the
        phase the block runs within, whose own clock counts it too; None: none)."""
        started = time.perf_counter()
        try:
            with self.job.goodput.phase(phase):
                yield
        finally:
            if inside is not None:
                self.job.goodput.add(inside, -(time.perf_counter() - started))

    def _log_eval(self, result: EvalResult) -> None:
        """Log an evaluation's metrics unless they are in MLflow already (one history read per process)."""
        rows = [(f"{result.name}/{k}", v, result.step) for k, v in sorted(result.metrics.items())]
        self.tracker.log_metrics_once(rows, rows[0][0], result.step)

    def reconcile_eval_metrics(self, step: int | None = None) -> int:
        """Log to MLflow every recorded evaluation that MLflow lacks; returns how many records it checked.

        Eval metrics reach MLflow in the background, so a process can die after writing an eval
        record and before its metrics are in MLflow. The job's evaluator (the trainer in local
        mode, the evaluate flow otherwise) calls this once per process, before it evaluates: the
        record is the durable truth, and nobody else writes eval metrics, so each is logged
        exactly once. `step` names a committed step whose checkpoint names the MLflow run, for an
        evaluator that has not joined it yet.
        """
        self._evals_reconciled = True
        if not self.tracker.started:  # an evaluator: join the trainer's run, leave its status alone
            steps = self.committed_steps()
            source = step if step is not None and (step in steps or step == self.step) else (steps[-1] if steps else None)
            if source is None:
                self._evals_reconciled = False  # nothing to join yet: try again next time
                return 0
            self.job.attach_tracking(self._params(), self.job.read_meta(source).get("mlflow_run_id"), reopen=False)
        self._warm_registry()  # (once per evaluating process, as this)
        recorded = [r for r in self.records.all() if r.metrics]
        for result in recorded:
            self._log_eval(result)
        return len(recorded)

    # -- export ----------------------------------------------------------------------

    def export(self, result: EvalResult) -> dict[str, str]:
        """Run every exporter on an evaluated result; returns ``{exporter name: export dir}``.

        Also on a result found already evaluated (NO_NEW_CHECKPOINT): exports written before
        are kept as they are, and those a crash left unwritten are written now.
        """
        with self.job.goodput.phase("export"):
            exported = self._export(result)
        if exported:
            self._push_compiled()
        return exported

    def _export(self, result: EvalResult) -> dict[str, str]:
        self._stop_if_preempted()
        written: dict[str, str] = {}
        if result.pending_commit:  # exports are of committed, recorded steps: this one's commit comes first
            max_steps = self.config.train.max_steps
            if all(exp.exports_nothing(e, self.storage, result, max_steps) for e in self.config.eval.exporters):
                return written  # nothing to export: training goes on, and the step is recorded once it commits
            mine = self._pending is not None and self._pending[0].step == result.step
            recorded = self._record_pending(wait=True, inside="export") if mine else self.records.get(result.step)
            if recorded is None:
                return written
            result = recorded
        if not exp.is_recorded(result) or not self.job.is_primary:
            return written
        self.job.verify_lease()  # a trainer whose job was taken over exports nothing more
        model: list[bytes] = []

        def make_model() -> bytes:
            if not model:
                self._wait_for_compile_cache()
                model.append(exp.serialize_serving(self.program, self._state_at(result.step), self.config.eval.export_platforms))
            return model[0]

        storage = self.storage
        info = {"program": self.config.program, "program_fingerprint": self.program_fingerprint, "job": self.config.job}
        for exporter in self.config.eval.exporters:
            dest = exp.run_exporter(exporter, storage, result, self.config.train.max_steps, make_model, info)
            if dest is None:
                continue
            written[exporter.name] = dest
        if written:
            self._register_exports()
        return written

    @property
    def registered_model(self) -> str | None:
        """The MLflow registered model of this job's exports (None: not registered)."""
        name = self.config.eval.registered_model
        return (self.config.job if name is None else name) or None

    def _warm_registry(self) -> None:
        """Where this process will register exports (it evaluates: a trainer of the `train` role
        never does), the MLflow worker makes that ready while it evaluates (see
        `Tracker.warm_registry`; a command or a flow run that evaluates asks at its start)."""
        if self.config.eval.registers_exports and self.job.is_primary and self.tracker.enabled:
            self.tracker.warm_registry()

    def _register_exports(self) -> None:
        """Every exported step becomes (once) a version of the registered model, and each
        exporter's alias moves to its step: ``best`` from the durable eval records, ``final``,
        ``newest``."""
        name = self.registered_model
        if name is None or not self.tracker.enabled:
            return
        storage, aliases, exported = self.storage, {}, set()
        for exporter in self.config.eval.exporters:
            steps = exp.exported_steps(storage, exporter.name)
            exported.update(steps)
            if isinstance(exporter, BestExporter):  # the best recorded (so committed) evaluation that was exported
                scored = [r for r in map(self.records.get, steps) if r is not None and exporter.metric in r.metrics]
                sign = 1 if exporter.mode == "min" else -1  # ties: the earliest step, as the exporter keeps it
                step = min(scored, key=lambda r: (sign * r.metrics[exporter.metric], r.step)).step if scored else None
            else:
                step = steps[-1] if steps else None
            if step is not None:
                aliases[alias_for(exporter.name)] = int(step)
        if not aliases:
            return

        def recorded(result: dict) -> None:
            storage.write_json(storage.path("registry.json"), {"tracking_uri": redact_url(self.tracker.tracking_uri), **result})

        description = (
            f"Exports of prefect-jax job `{self.config.job}` ({redact_url(storage.job_dir)}), one version per exported step. "
            f"Aliases: {', '.join('@' + a for a in sorted(aliases))}. Serve: `mlflow.pyfunc.load_model('models:/{name}@best')`."
        )
        local_export = exp.LocalExport(storage, tuple(e.name for e in self.config.eval.exporters))
        self.tracker.register_exports(name, self.config.job, aliases, local_export, self._serving_example(), on_done=recorded,
                                      description=description, steps=sorted(exported))  # fmt: skip

    def _serving_example(self):
        """A few real inputs for the model's signature and input example: rows of the first eval
        batch that fit the serving input (zeros of its shape if none does)."""
        if self._example is None:
            self._example = exp.serving_example(self.program)
        return self._example

    # -- end -------------------------------------------------------------------------

    def fingerprint(self) -> str:
        self._require_live()
        return state_fingerprint(self.loop.local(self.state))

    def goodput(self) -> dict[str, Any]:
        """The job's goodput so far, over every attempt (see `prefect_jax.training.goodput`)."""
        return self.job.goodput.summary()

    def _log_goodput(self) -> None:
        """The goodput summary to MLflow (``goodput/*`` metrics at the current step, ``goodput.json``)."""
        if self.job.goodput.attempt is not None and self.step is not None:
            self.tracker.log_goodput(self.goodput(), self.step)

    def finish(self, status: str = "FINISHED") -> None:
        """Wait for pending saves, close the MLflow run with `status`, release the lease."""
        try:
            if status == "FINISHED":
                self.job.verify_lease()  # a job taken over is not this process's to call finished
                self._record_pending(wait=True)
            else:
                self._record_pending_or_warn()
            self._flush_compiled(0.0 if status == "KILLED" else END_FLUSH_SECS)  # KILLED: SIGTERM's handler waited
            if self.job.goodput.attempt is not None:
                self.job.wait_committed(ending=status != "FINISHED")
                self.job.goodput.end(self._ended_as({"FINISHED": "finished", "KILLED": "preempted"}.get(status, status.lower())))
                self._log_goodput()
            self.job.finish(status)
            if status == "FINISHED":
                mark_cluster_finished()
            elif status == "KILLED":  # preempted, its checkpoint committed: its leaving is no loss to the others
                say_goodbye()
        finally:
            self._guard.uninstall()

    def close(self) -> None:
        try:
            self._record_pending_or_warn()
            self.job.goodput.end(self._ended_as("closed"))  # (unless it ended already) not a kill, unless a process went away
            self.loop.join_precompile()
            self._flush_compiled(END_FLUSH_SECS)
            self.job.close()
        finally:
            self._guard.uninstall()


def _within(fn, timeout: float) -> bool:
    """Run `fn` on a helper thread; True if it returned within `timeout` seconds."""
    worker = threading.Thread(target=fn, daemon=True)
    worker.start()
    worker.join(timeout=max(0.0, timeout))
    return not worker.is_alive()
