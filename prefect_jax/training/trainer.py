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

import logging
import time
from collections.abc import Callable
from typing import Any

from prefect_jax.training import control
from prefect_jax.training.cluster import forget_lost, from_primary, note_failure
from prefect_jax.training.cluster import initialize as initialize_cluster
from prefect_jax.training.compile_cache import open_compilation_cache
from prefect_jax.training.ending import AttemptEnd
from prefect_jax.training.errors import ExportFailedError
from prefect_jax.training.evaluating import Evaluations
from prefect_jax.training.evaluation import EvalResult
from prefect_jax.training.exporting import Exports
from prefect_jax.training.head_start import adopt as adopt_head_start
from prefect_jax.training.intervals import Intervals
from prefect_jax.training.job import Job
from prefect_jax.training.loop import Loop
from prefect_jax.training.policy import CheckpointPolicy
from prefect_jax.training.preemption import PreemptionGuard
from prefect_jax.training.preflight import check_job_parts
from prefect_jax.training.program import load_program_with_params, program_fingerprint
from prefect_jax.training.program_params import ProgramParams
from prefect_jax.training.progress import add_progress_listener
from prefect_jax.training.serving import check_serving
from prefect_jax.training.session import (
    recover_session,
    recover_trainer,
    restore_or_init,
    restore_trainer,
)
from prefect_jax.training.specs import MAX_WAIT_SECS, RECOVERY_WAIT_SECS, JobConfig

logger = logging.getLogger("prefect_jax.trainer")

__all__ = ["Trainer", "add_progress_listener", "recover_session", "restore_or_init"]

# How long a "no stop" answer stands at the same live step (`Trainer.stop_requested`): the flow's
# ask and its train task's, moments apart; not a task retry (RetrySpec's delay on), nor anyone
# polling.
STOP_ANSWER_SECS = 1.0


class Trainer:
    """One job's live training session: a `Job` (storage, lease, MLflow run) and a `Loop`
    (compiled steps, data), with the live state between them.

    Its rooms: `policy` (when to checkpoint, `CheckpointPolicy`), `intervals` (train and save),
    `evaluations` (and their `pending` record), `exports`, `ending` (finish, close, SIGTERM).

    Args:
        config: the job.
        program: the program object (loaded from ``config.program`` when None).
        run_tags: extra metadata stored in checkpoints and MLflow tags (e.g. the Prefect
            flow-run id, which also names the owner of the job's lease).
    """

    def __init__(
        self, config: JobConfig, program: Any = None, run_tags: dict[str, str] | None = None
    ):
        # several JAX processes (from the environment): joined before JAX picks its devices
        initialize_cluster()
        forget_lost()  # (a lost process seen by an earlier trainer in this process is not its)
        self.config = config
        # (the command's compile, begun before its flow run: `prefect_jax.training.head_start`)
        head = adopt_head_start(config) if program is None else None
        if head is not None:
            program, self.program_params = head.program, head.program_params
        elif program is None:
            program, self.program_params = load_program_with_params(
                config.program, config.program_params, config.train.max_steps
            )
        else:  # built by the caller: its params are what the job says
            self.program_params = ProgramParams(values=dict(config.program_params or {}))
        self.program = program
        self.job = Job(config, run_tags)
        try:
            self.compile_cache = None  # a mirror of a cache on remote storage (see compile_cache)
            if head is not None and head.cache_opened:
                self.compile_cache = head.compile_cache
            elif config.compilation_cache_dir:
                self.compile_cache = open_compilation_cache(
                    config.compilation_cache_dir, self.job.storage, push=self.job.is_primary
                )
            self.program_fingerprint = program_fingerprint(config.program, self.program)
            self.train_hooks = check_job_parts(
                self.program, config.program, config.eval.exporters, config.train.hooks
            )
            self.metrics_settled = head is not None and head.checked_metrics_of(config.eval)
            self.loop = (
                head.loop
                if head is not None
                else Loop(program, config.train, config.program_params)
            )
            self.loop.compiling.save_copy = self.job.checkpoints.device_copy
            # a serve() that does not trace, or lower for named platforms: refused now, not an
            # interval in (unless the command's preflight did, for these platforms)
            checked = head.serving_checked if head is not None else None
            if config.eval.exporters and checked != tuple(config.eval.export_platforms or ()):
                check_serving(
                    self.program,
                    config.program,
                    self.loop.abstract_state,
                    config.eval.export_platforms,
                )
        except BaseException:
            try:
                # its lease (a flow run's restore task took it early), its MLflow worker
                self.job.close()
            except Exception:  # noqa: BLE001 - the refusal above is what the caller must see
                logger.warning(
                    "could not close job %s after its trainer was refused",
                    config.job,
                    exc_info=True,
                )
            raise
        self.state = None
        self.step: int | None = None
        self.data_iter = None
        self.last_train_metrics: dict[str, float] = {}
        self.started_from: int | None = None  # the step the live state was restored / made at
        self.warm_started = False  # the live state came from another job's step (checkpoint_path)
        self.live_is_preemption = False  # the live step was restored from a preemption checkpoint
        self.recovered = False  # the live state came from `recover`: evaluated, never trained on
        self.trains_on: str | None = None  # its devices (and mesh), once restored to train on
        # (live step, monotonic time) of the last "no stop" read
        self._no_stop_at: tuple[int, float] | None = None
        self.policy = CheckpointPolicy.for_training(config.checkpoint, config.train.max_steps)
        self.eval_hooks = control.load_hooks(config.eval.hooks)
        es = config.eval.early_stopping
        self.early_stopping = control.EarlyStoppingHook.of(es) if es else None
        self.intervals = Intervals(self)
        self.evaluations = Evaluations(self, on_stop=self.forget_stop_answer)
        self.exports = Exports(self)
        self.ending = AttemptEnd(self)
        self.guard = PreemptionGuard(self.ending.on_sigterm)

    def committed_steps(self) -> list[int]:
        return self.job.committed_steps()

    def stop_requested(self) -> dict | None:
        """The job's durable stop request, if any. With several processes, process 0's answer in
        every process (a collective: they all call it at the same point, and agree whether to go
        on). With one process, asked again at the same live step within `STOP_ANSWER_SECS` (the flow
        asks before each train task, and the task at its start), a "no stop" answer stands: no
        second read of the job's storage (a GET on object storage). A request made in between is
        seen at the next ask; one that this trainer's evaluation makes (early stopping), at once."""
        if self.job.processes == 1:
            last = self._no_stop_at
            if (
                last is not None
                and last[0] == self.step
                and time.monotonic() - last[1] < STOP_ANSWER_SECS
            ):
                return None
            stop = self.job.stop_requested()
            self._no_stop_at = (
                (self.step, time.monotonic()) if stop is None and self.step is not None else None
            )
            return stop
        stop = self.job.stop_requested() if self.job.is_primary else None
        if not from_primary(stop is not None):
            return None
        return stop or self.job.stop_requested() or {"reason": "stop requested (see process 0)"}

    def forget_stop_answer(self) -> None:
        self._no_stop_at = None

    # -- restore ---------------------------------------------------------------------

    def restore_or_init(
        self,
        checkpoint_path: str | None = None,
        wait_for_checkpoint: bool = False,
        max_wait_secs: float = MAX_WAIT_SECS,
        recovery_wait_secs: float = RECOVERY_WAIT_SECS,
        evaluates: bool = True,
    ) -> int:
        """Take the job's lease, then resume from its latest readable committed step; else from
        `checkpoint_path`; else init. `evaluates`: False for the train role (its evaluator checks
        the metrics that `config.eval` names).

        Torn steps (never committed) and unreadable or corrupt ones are moved aside with a
        warning naming the step. Also finds (or creates) the job's MLflow run. Returns the step
        the state is at.

        Raises:
            LeaseHeldError: another live trainer holds the job.
            PastMaxStepsError: the job's newest step is past `max_steps`.
            BadInputError: a new job's best exporter or early stopping names a metric that the
                evaluation does not produce.
            NoProgressError: past the rerun budget (see `Job.record_attempt`).
        """
        try:
            waits = (wait_for_checkpoint, max_wait_secs, recovery_wait_secs)
            return restore_trainer(self, checkpoint_path, *waits, evaluates)
        except Exception as exc:
            # several processes: a peer lost in the collective restore, or this one's own failure
            note_failure(exc)
            raise

    def recover(
        self,
        step: int | None = None,
        wait_for_checkpoint: bool = False,
        max_wait_secs: float = MAX_WAIT_SECS,
        recovery_wait_secs: float = RECOVERY_WAIT_SECS,
        evaluates: bool = False,
    ) -> tuple[bool, int | None]:
        """TF's `SessionManager.recover_session`: restore the job's committed `step` (None: its
        newest readable one) as the live state, for evaluation and export, or nothing; never
        init (`session.recover_trainer` says what it leaves alone). `evaluates` (an evaluator):
        the metrics that `config.eval` compares are checked first.

        Returns:
            ``(restored, step)``: ``(False, None)`` where there is no such committed step.
        """
        waits = (wait_for_checkpoint, max_wait_secs, recovery_wait_secs)
        return recover_trainer(self, step, *waits, evaluates)

    # -- the verbs: train, evaluate, export ------------------------------------------

    def train_until_checkpoint(self) -> int:
        """Train until the next checkpoint is due, save it asynchronously, return the step reached.

        Training metrics stay on the device during the interval and go to MLflow in one batch
        at its end. A NaN/Inf loss is looked for every `log_every_steps` and before the save;
        it raises `NonFiniteLossError` naming the step and nothing of it is checkpointed.
        On SIGTERM the step in flight finishes, is checkpointed within `sigterm_grace_secs`,
        and the signal goes on (see `PreemptionGuard`).
        Once attempts of the job were killed without notice, backups (resume-only checkpoints,
        `CheckpointSpec.backups`) are written within the interval, which goes on after each.
        """
        self._require_live()
        if self.recovered:
            raise RuntimeError(
                f"the live state of job {self.config.job!r} (step {self.step}) was recovered for "
                "evaluation and export, without the job's lease: call restore_or_init() to train"
            )
        return self.intervals.train_until_checkpoint()

    def evaluate_if_new(
        self,
        step: int | None = None,
        force: bool = False,
        on_recorded: Callable[[EvalResult], None] | None = None,
    ) -> EvalResult:
        """Evaluate `step` (default: the live step, else the newest committed one) unless done
        before.

        Returns an EvalResult with status EVALUATED (metrics logged to MLflow and recorded
        durably), NO_NEW_CHECKPOINT (already evaluated), MISSING_CHECKPOINT (nothing to
        evaluate), THROTTLED (evaluated less than `throttle_secs` ago; `force` overrides) or
        EVALUATION_STOPPED (an eval listener stopped this trainer's evaluations).

        A step is recorded only once its checkpoint has committed. The live step's save is
        usually still in flight here: then the result is EVALUATED with ``pending_commit``, and
        it is recorded once the step commits, by the training that goes on meanwhile (or by the
        next save, evaluation, export or `finish`), so that training does not wait for the commit.
        Where something decides on the result before training goes on (early stopping, eval
        hooks, the final step) or the job has several processes, this waits for the commit and
        records the step before it returns. `on_recorded(result)` is called once the result is
        recorded, now or later (never if the step does not commit).
        """
        return self.evaluations.evaluate_if_new(step, force, on_recorded)

    def reconcile_eval_metrics(self, step: int | None = None) -> int:
        """Log to MLflow every recorded evaluation that MLflow lacks; returns how many records it
        checked.

        Eval metrics reach MLflow in the background, so a process can die after writing an eval
        record and before its metrics are in MLflow. The job's evaluator (the trainer in local
        mode, the evaluate flow otherwise) calls this once per process, before it evaluates: the
        record is the durable truth, and nobody else writes eval metrics, so each is logged
        exactly once. `step` names a committed step whose checkpoint names the MLflow run, for an
        evaluator that has not joined it yet.
        """
        return self.evaluations.reconcile(step)

    def export(self, result: EvalResult) -> dict[str, str]:
        """Run every exporter on an evaluated result; returns ``{exporter name: export dir}`` of
        what it wrote.

        Also on a result found already evaluated (NO_NEW_CHECKPOINT): exports written before
        are kept as they are (and registered, where a kill came before that), and those a crash
        left unwritten are written now.
        """
        return self.exports.export(result)

    def export_in_background(
        self, result: EvalResult, on_done: Callable[[dict[str, str]], None]
    ) -> None:
        """`export`, lowered and written on a thread while training goes on: the decisions (is
        the step committed and recorded, does an exporter export it) and a host copy of the state
        are made here; `on_done(written)` is called on that thread once written and registered.
        The next checkpoint's save waits for it; the next export, `finish` and `join_exports`
        too, and raise `ExportFailedError` if it failed."""
        self.exports.export(result, on_done=on_done)

    def join_exports(self) -> dict[str, str]:
        """Wait for the export in the background (`export_in_background`); what it wrote."""
        return self.exports.join()

    @property
    def registered_model(self) -> str | None:
        """The MLflow registered model of this job's exports (None: not registered)."""
        return self.exports.registered_model

    # -- the live state and the compilation cache ------------------------------------

    def _require_live(self):
        self.ending.stop_if_preempted()
        if self.state is None:
            raise RuntimeError("no live state: call restore_or_init() first")

    def forget_live_state(self) -> None:
        """The live state is somewhere inside an interval (its buffers may have been donated):
        drop it, so the next attempt restores the last committed checkpoint."""
        self.state = self.step = self.data_iter = None

    def wait_for_compile_cache(self) -> None:
        """Before compiling: let the entries of a cache on remote storage arrive (pulled since
        the trainer was made, overlapping its set-up)."""
        if self.compile_cache is not None:
            self.compile_cache.wait_pulled()

    def push_compiled(self) -> None:
        """Copy new compilation cache entries to storage in the background. A SIGTERM meanwhile is
        handled once the entries are listed: its handler flushes the same cache."""
        if self.compile_cache is not None:
            with self.guard.deferred():
                self.compile_cache.push_async()
            self.guard.handle_if_pending()

    def flush_compiled(self, timeout: float) -> None:
        """`push_compiled`, then wait up to `timeout` seconds for the copies."""
        if self.compile_cache is not None:
            self.push_compiled()
            self.compile_cache.wait(timeout)

    # -- end -------------------------------------------------------------------------

    def fingerprint(self) -> str | None:
        """A digest of the live state's every bit (`state_fingerprint`). A state sharded over
        several processes is digested where its shards are (a collective: every process calls
        this); process 0 returns it, the others None."""
        self._require_live()
        return self.loop.fingerprint(self.state)

    def goodput(self) -> dict[str, Any]:
        """The job's goodput so far, over every attempt (see `prefect_jax.training.goodput`)."""
        return self.job.goodput.summary()

    def finish(self, status: str = "FINISHED") -> None:
        """Wait for pending saves and the export in the background (its failure raised when
        `status` is FINISHED), close the MLflow run with `status`, release the lease, and free
        the live state's device memory (the step stays: the flow's summary names it)."""
        try:
            self.exports.join_at_end(raise_failure=status == "FINISHED")
        except ExportFailedError:
            # closed as failed here, not left to a flow's failure hook (the engine runs without)
            self.ending.finish("FAILED")
            raise
        self.ending.finish(status)

    def release_state(self) -> None:
        """Free the live state's device memory as the flow run that used it ends (the step stays:
        its summary names it); kept, every job a notebook or sweep runs stays on the device."""
        self.state = self.data_iter = None

    def close(self) -> None:
        self.exports.join_at_end(raise_failure=False)
        self.ending.close()
