"""A trainer's evaluations of its job's steps: each committed step once, recorded durably.

TensorFlow's continuous evaluation, as a trainer (local mode) or an evaluator process does it:
evaluate the live step (else the newest committed one) unless it was evaluated before, log its
metrics to MLflow at the step, write the durable eval record, ask the job to stop when early
stopping or a hook's `should_stop_job` says so, and stop evaluating when an eval listener's
`before_eval` / `after_eval` answers False (TF's `_ContinuousEvalListener`). The live step's
save may still be in flight: its evaluation is then recorded once the step commits (`pending`).
This module never imports prefect.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prefect_jax.training import control
from prefect_jax.training.checksums import CorruptCheckpointError
from prefect_jax.training.cluster import LostProcess, lost_process
from prefect_jax.training.collective import EVALUATE, FAILED, GATHER, announce, worst
from prefect_jax.training.evaluation import EvalResult, EvalStatus, throttled
from prefect_jax.training.exporters import nothing_to_export
from prefect_jax.training.names import MAX_TAG_VALUE, STOP_REASON_TAG, TRAIN_PREFIX
from prefect_jax.training.pending import OnRecorded, PendingEvaluation, may_record_later
from prefect_jax.training.tracking_params import job_params

if TYPE_CHECKING:
    from prefect_jax.training.trainer import Trainer

logger = logging.getLogger("prefect_jax.trainer")


class Evaluations:
    """The evaluations of one trainer's job (see `Trainer.evaluate_if_new`).

    Args:
        trainer: the trainer whose live state and job are evaluated.
        on_stop: called when an evaluation asked the job to stop (the trainer's stop answer
            is stale then).
    """

    def __init__(self, trainer: Trainer, on_stop: Callable[[], None]):
        self.trainer, self.on_stop = trainer, on_stop
        self.pending = PendingEvaluation(trainer.job, self.record)
        self.reconciled = False  # this process logged the recorded evaluations MLflow lacked
        # This trainer evaluates its own live steps (local mode: set by the flow that does), so
        # its final step is evaluated while that step's checkpoint commits (`Intervals.save`).
        self.of_live_steps = False
        # Why an eval listener stopped this trainer's evaluations (in memory, as TF's listener:
        # a new process asks its own listeners again).
        self.stopped: str | None = None
        # A state sharded over several processes: the live step's host copy (process 0's, for
        # its exports), and whether process 0 told the others what this evaluation does.
        self.host: tuple[int, object] | None = None
        self._announced = False

    def evaluate_if_new(
        self, step: int | None, force: bool, on_recorded: OnRecorded | None
    ) -> EvalResult:
        """`Trainer.evaluate_if_new`."""
        t = self.trainer
        # a trainer's own evaluations (an evaluator keeps no ledger)
        with t.job.goodput.phase("eval"):
            if t.loop.spans:
                result = self._together(step, force, on_recorded)
            else:
                result = self._evaluate_if_new(step, force, on_recorded)
        if result.status == EvalStatus.EVALUATED:
            t.push_compiled()
        return result

    def _together(self, step: int | None, force: bool, on_recorded) -> EvalResult:
        """A state sharded over several processes: process 0 decides as it does alone, and tells
        the others what to join (`collective.announce`): first the eval step on the live state;
        then, once its result says whether any exporter may write (`exporters.nothing_to_export`:
        not a FinalExporter before the final step, nor a BestExporter that was not beaten), the
        gather of the state to the host for the exports. Then every process says how its part
        ended (`collective.worst`): a failure anywhere fails the evaluation in every process, so
        that a retry of the task starts in all of them at once. Every process of such a job calls
        this at the same points, and makes the same three collective calls whatever fails."""
        t, job, name = self.trainer, self.trainer.job, self.trainer.config.eval.name
        self.host, self._announced = None, False
        result, error = None, None
        if not job.is_primary:
            try:
                self._join(announce(None))
            except Exception as exc:  # noqa: BLE001 - said to the others below, then raised
                error = exc
            try:
                self._gather(announce(None))
            except Exception as exc:  # noqa: BLE001 - said to the others below, then raised
                error = error or exc
            ended = worst(FAILED if error else 0)
        else:
            try:
                result = self._evaluate_if_new(step, force, on_recorded)
            except Exception as exc:  # noqa: BLE001 - said to the others below, then raised
                error = exc
            if not self._announced:  # nothing evaluated
                try:
                    self._join(announce(0))
                except Exception as exc:  # noqa: BLE001 - said to the others below, then raised
                    error = error or exc
            gathers = error is None
            if gathers:
                try:
                    gathers = self._exports_may_need_the_live_state(result)
                except Exception as exc:  # noqa: BLE001 - the export task meets it, and says so
                    logger.warning("gathering step %s for its exports anyway: %s", t.step, exc)
            try:
                self._gather(announce(GATHER if gathers else 0))
            except Exception as exc:  # noqa: BLE001 - said to the others below, then raised
                error = error or exc
            stopped = result is not None and result.evaluation_stopped is not None
            ended = worst(FAILED if error else int(stopped))
        if error is not None:
            raise error
        if ended == FAILED:
            raise RuntimeError(
                f"another process's part of the evaluation of step {t.step} failed (its log says "
                "why): this process's part ends too, so that a retry starts in every process"
            )
        if job.is_primary:
            return result
        if ended:
            self.stopped = "process 0 stopped evaluating"
            return EvalResult(
                status=EvalStatus.EVALUATION_STOPPED,
                name=name,
                step=step,
                evaluation_stopped=self.stopped,
            )
        return EvalResult(status=EvalStatus.OTHER_PROCESS, name=name, step=step)

    def _join(self, code: int):
        """What process 0 announced first, done by every process: `loop.evaluate` of the live
        state (its metrics returned)."""
        t = self.trainer
        self._announced = True
        return t.loop.evaluate(t.state, t.config.eval.steps) if code & EVALUATE else None

    def _gather(self, code: int) -> None:
        """What process 0 announced next, done by every process: the live state's gather to the
        host (kept by process 0, for its exports: `state_at`)."""
        t = self.trainer
        if code & GATHER:
            host = t.loop.local(t.state)
            self.host = (t.step, host) if t.job.is_primary else None

    def _exports_may_need_the_live_state(self, result: EvalResult | None) -> bool:
        """Whether process 0's exports after `result` may need the live state on its host: an
        evaluation of the live step (or its record, found again) after which some exporter may
        write. The gather moves the whole state to one host: not for nothing."""
        t = self.trainer
        exporters = t.config.eval.exporters
        if result is None or not exporters or t.state is None or result.step != t.step:
            return False
        if result.status not in (EvalStatus.EVALUATED, EvalStatus.NO_NEW_CHECKPOINT):
            return False
        return not nothing_to_export(exporters, t.job.storage, result, t.config.train.max_steps)

    def _evaluate_if_new(self, step: int | None, force: bool, on_recorded) -> EvalResult:
        t, job = self.trainer, self.trainer.job
        t.ending.stop_if_preempted()
        spec = t.config.eval
        self.pending.record(wait=True, inside="eval")
        if not job.is_primary:  # process 0 evaluates its replica; the others go on training
            return EvalResult(status=EvalStatus.OTHER_PROCESS, name=spec.name, step=step)
        if job.lease.held:  # the trainer evaluating its own steps (local mode)
            t.guard.install()
        if step is None:
            step = t.step if t.state is not None else job.newest_committed()
        if self.stopped is not None:
            return EvalResult(
                status=EvalStatus.EVALUATION_STOPPED,
                name=spec.name,
                step=step,
                evaluation_stopped=self.stopped,
            )
        live = t.state is not None and t.step == step
        missing = EvalResult(status=EvalStatus.MISSING_CHECKPOINT, name=spec.name, step=step)
        if step is None or (not live and not job.is_committed(step)):
            return missing
        if not self.reconciled:
            self.reconcile(step)
        # The live step's save still in flight: no record of it can exist (a step is recorded, by
        # this trainer or an evaluator, once it is committed; a rerun moved aside the records past
        # the step it resumed from), so none is read (a round trip on object storage).
        restored = step == t.started_from
        in_flight = live and not restored and job.processes == 1 and not job.save_landed()
        done = None if in_flight else job.records.get(step)
        if done is not None:
            return done.model_copy(update={"status": EvalStatus.NO_NEW_CHECKPOINT})
        is_final = t.config.train.is_final(step)
        if not is_final and self._is_preemption_checkpoint(step, live):
            logger.info(
                "step %d is a preemption checkpoint (off the every_steps cadence): kept to resume "
                "from, not evaluated",
                step,
            )
            return EvalResult(status=EvalStatus.PREEMPTION_CHECKPOINT, name=spec.name, step=step)
        if not (force or is_final) and throttled(job.records, spec.throttle_secs):
            return EvalResult(status=EvalStatus.THROTTLED, name=spec.name, step=step)
        started_at = time.time()  # (throttle_secs counts from here, as TF's timer does)
        stopped = control.before_eval_stop(t.eval_hooks, step)
        if stopped:
            return self._stop_evaluating(
                EvalResult(status=EvalStatus.EVALUATION_STOPPED, name=spec.name, step=step),
                stopped,
            )
        try:
            # (a state sharded over processes: the live one, evaluated by every process)
            state = t.state if t.loop.spans and live else self.state_at(step)
        except CorruptCheckpointError as exc:
            logger.error("not evaluating step %d: %s", step, exc)
            return missing
        t.wait_for_compile_cache()
        if t.loop.spans:
            self._announced = True  # (even where the broadcast fails: it is not made again)
            metrics, n, examples = self._join(announce(EVALUATE))
        else:
            # (a SIGTERM met by the trainer's caller: given up, as the signal's handler would)
            give_up = lambda: t.guard.requested  # noqa: E731 - (a notice its caller met)
            metrics, n, examples = t.loop.evaluate(state, spec.steps, give_up=give_up)
        result = EvalResult(
            status=EvalStatus.EVALUATED,
            name=spec.name,
            step=step,
            metrics=metrics,
            num_batches=n,
            num_examples=examples,
            evaluated_at=time.time(),
            started_at=started_at,
            is_final=is_final,
            checkpoint_path=f"{job.checkpoint_location}/{step}",
        )
        # The live step's save may still be in flight (the evaluation overlapped it): a step is
        # recorded, logged and exported only once it is committed, so that a crash before the
        # commit leaves nothing that says it was evaluated (the rerun evaluates it again). (Asked
        # only where it may wait: with several processes Orbax's flag is behind their barriers.)
        decides = t.early_stopping is not None or bool(t.eval_hooks)
        if (
            live
            and not restored
            and may_record_later(is_final, decides, job.processes)
            and not job.save_landed()
        ):
            return self.pending.hold(result, on_recorded)
        if live and not self._committed(step):
            logger.error("step %d did not commit: its evaluation is not recorded", step)
            return missing
        return self.record(result, on_recorded)

    def _stop_evaluating(self, result: EvalResult, reason: str) -> EvalResult:
        """An eval listener stopped evaluating: no evaluation or export by this trainer from now
        on; `result` says why."""
        self.stopped = reason
        logger.warning("%s", reason)
        return result.model_copy(update={"evaluation_stopped": reason})

    def _is_preemption_checkpoint(self, step: int, live: bool) -> bool:
        if live:
            return self.trainer.live_is_preemption
        try:
            return bool(self.trainer.job.read_meta(step).get("preemption"))
        except Exception:  # noqa: BLE001 - unreadable metadata: the evaluation says what is wrong
            return False

    def state_at(self, step: int):
        """The state at `step` in this process alone: the live one (this process's replica), or
        restored."""
        t, job = self.trainer, self.trainer.job
        if t.loop.spans and self.host is not None and self.host[0] == step:
            return self.host[1]  # gathered by every process when process 0 evaluated it
        if t.state is not None and t.step == step and not t.loop.spans:
            return t.loop.local(t.state)
        if t.loop.spans and t.state is not None and t.step == step:
            raise ValueError(
                f"step {step} is sharded over {job.processes} JAX processes and was not gathered "
                "when it was evaluated: export it with the export flow, in its own process"
            )
        if job.processes > 1:  # Orbax's restore is collective: one process alone would wait forever
            raise ValueError(
                f"step {step} is not the live step ({t.step}): with {job.processes} JAX processes, "
                "process 0 evaluates and exports the live step only; evaluate older steps with the "
                "evaluate flow, in its own process"
            )
        return job.restore(step, t.loop.abstract_state)[0]

    def _committed(self, step: int) -> bool:
        """Whether `step` counts, once the saves in flight have landed (waits for them). The state
        training started from counts too: committed, or made by init (or a warm start), which a
        rerun makes again, bit for bit."""
        t, job = self.trainer, self.trainer.job
        if step == t.started_from:
            return True
        if step == t.step:
            try:
                self.pending.wait_committed(inside="eval")
            # another process went away after its part of the commit: process 0's is final
            except LostProcess:
                if not job.is_committed(step):
                    raise
                logger.warning(
                    "step %d is committed (another process went away after it: %s)",
                    step,
                    lost_process(),
                )
        return job.is_committed(step)

    def _log(self, result: EvalResult) -> None:
        """Log an evaluation's metrics unless they are in MLflow already (one history read per
        process)."""
        rows = [(f"{result.name}/{k}", v, result.step) for k, v in sorted(result.metrics.items())]
        self.trainer.job.tracker.log_metrics_once(rows, rows[0][0], result.step)

    def reconcile(self, step: int | None = None) -> int:
        """`Trainer.reconcile_eval_metrics`."""
        t, job = self.trainer, self.trainer.job
        self.reconciled = self.join_job_run(step)
        if not self.reconciled:
            return 0  # nothing to join yet: try again next time
        t.exports.warm_registry()  # (once per evaluating process, as this)
        recorded = [r for r in job.records.all() if r.metrics]
        for result in recorded:
            self._log(result)
        return len(recorded)

    def join_job_run(self, step: int | None = None) -> bool:
        """Join the job's MLflow run, named in the checkpoint of `step` (None, or not committed:
        the newest), where this process started none: an evaluator's or an exporter's, its
        status left alone. False where there is no committed step to name it."""
        t, job = self.trainer, self.trainer.job
        if job.tracker.started:
            return True
        steps = job.committed_steps()
        source = step if step is not None and (step in steps or step == t.step) else None
        source = source if source is not None else (steps[-1] if steps else None)
        if source is None:
            return False
        run_id = job.read_meta(source).get("mlflow_run_id")
        job.attach_tracking(job_params(t.config, t.program, t.program_params), run_id, reopen=False)
        return True

    def record(self, result: EvalResult, on_recorded: OnRecorded | None) -> EvalResult:
        """Log an evaluation of a committed step to MLflow, record it durably, ask for a stop if
        its hooks say so; then `on_recorded(result)`."""
        t, job = self.trainer, self.trainer.job
        step, spec, metrics, is_final = result.step, t.config.eval, result.metrics, result.is_final
        job.verify_lease()  # a trainer whose job was taken over records nothing more
        # Unless a crash came between this log and the record below, in an earlier attempt.
        self._log(result)
        job.records.put(result)
        last = t.last_train_metrics
        train_key = TRAIN_PREFIX + ("loss" if "loss" in last else next(iter(last), "loss"))
        job.tracker.log_learning_curve(
            step,
            train_key,
            [f"{spec.name}/{k}" for k in sorted(metrics)],
            min_interval_secs=0.0 if is_final else spec.learning_curve_every_secs,
        )
        reason = control.job_stop_reason(result, job.records, t.early_stopping, t.eval_hooks)
        if reason:
            logger.warning("%s: asking job %s to stop", reason, t.config.job)
            job.request_stop(reason, step, by=control.by_evaluation(spec.name))
            self.on_stop()
            job.tracker.set_tags({STOP_REASON_TAG: reason[:MAX_TAG_VALUE]})
            result = result.model_copy(update={"stop_reason": reason})
        stopped = control.after_eval_stop(t.eval_hooks, result)
        if stopped:
            result = self._stop_evaluating(result, stopped)
        if on_recorded is not None:
            try:
                on_recorded(result)
            # the record stands; what the caller publishes is best effort
            except Exception:  # noqa: BLE001
                logger.exception("after recording the evaluation of step %d", step)
        return result
