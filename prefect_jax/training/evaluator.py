"""The continuous evaluator: TensorFlow's evaluator task (`_TrainingExecutor.run_evaluator`) over a
job's storage, split as TF splits it: wait for the first checkpoint, find the steps to evaluate
next, evaluate one of them, and a loop over those until the job is done.

No Prefect here: the caller passes how a step is evaluated and how a result is exported (the
`evaluate` flow passes its tasks), how to log, and (tests) the clock and the sleep. What it has
evaluated is read from the job's durable records (`EvalRecords`), so a restarted evaluator never
evaluates a step twice.

Example:
    ```python
    from prefect_jax.training.evaluator import Evaluator
    from prefect_jax.training.live import get_trainer
    from prefect_jax.training.specs import JobConfig, TrainSpec

    config = JobConfig(program="prefect_jax.examples.digits:tiny", job="tiny",
                       storage="/tmp/prefect-jax", train=TrainSpec(max_steps=20))
    trainer = get_trainer(config)
    evaluator = Evaluator.for_job(config, lambda step: trainer.evaluate_if_new(step, force=True),
                                  once=True, wait_for_first_checkpoint_secs=60)
    evaluator.wait_for_first_checkpoint()
    print(evaluator.run(), evaluator.summary())
    ```
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from prefect_jax.training.errors import NoFirstCheckpointError
from prefect_jax.training.evaluation import EvalResult, EvalStatus, throttle_wait
from prefect_jax.training.specs import (
    EVAL_POLL_SECS,
    FIRST_CHECKPOINT_WAIT_SECS,
    JobConfig,
    is_final_step,
)

logger = logging.getLogger(__name__)


class Records(Protocol):
    """What the evaluator reads of the job's evaluation records (`EvalRecords` has it)."""

    def steps(self) -> list[int]: ...

    def get(self, step: int) -> EvalResult | None: ...


def trainer_alive(storage) -> bool:
    """Whether a trainer holds the job's lease (`JobStorage` `storage`) with a fresh heartbeat
    and, on this host, a live process: the test a trainer taking the lease over makes."""
    from prefect_jax.training.lease import Lease
    from prefect_jax.training.local_processes import holder_gone

    lease = Lease(storage)
    try:
        current = lease.read()
    except Exception:  # noqa: BLE001 - unreadable: as if no trainer, the idle timeout decides
        return False
    return bool(current) and holder_gone(current, lease.timeout_secs) is None


@dataclasses.dataclass
class Evaluator:
    """Evaluates every newly committed step of one job once, until the job is done.

    Args:
        job: the job's name (for messages).
        max_steps: the job's `TrainSpec.max_steps`: a step at or past it is the final one
            (None: the job trains until stopped; there is no final step, and the evaluator
            goes on until a stop request, `once`, the idle timeout, or its flow run's end).
        evaluate: evaluates a committed step, unthrottled (the evaluator throttles), and
            returns its `EvalResult`.
        records: the job's evaluation records (`EvalRecords`): what was evaluated.
        committed_steps: the job's committed checkpoint steps, oldest first.
        is_backup: whether a committed step is a backup (resume-only: never evaluated).
        stop_request: the job's stop request (an early-stopping hook's), or None.
        trainer_alive: whether a trainer still holds the job (the idle timeout waits for it).
        export: exports an evaluated result (None: no exporters).
        where: where the checkpoints are, for the message of a first checkpoint that never came.
        storage: the job's `JobStorage` (`for_job`'s), for the caller.
        every_checkpoint: evaluate every new step; False: only the newest.
        once: stop when nothing new is left to evaluate.
        start_delay_secs: wait this long before looking for the first checkpoint.
        throttle_secs: the least time between two evaluations (not before the final step).
        wait_for_first_checkpoint_secs: how long to wait for the first committed checkpoint.
        poll_secs: how often to look for new checkpoints.
        idle_timeout_secs: stop after this long without a new checkpoint while no trainer is
            alive (None: never).
        log: ``log(message, *args)`` for progress.
        warn: ``warn(message, *args)`` for steps lost to retention.
        clock: a monotonic clock, in seconds.
        sleep: sleeps a number of seconds.
    """

    job: str
    max_steps: int | None
    evaluate: Callable[[int], EvalResult]
    records: Records
    committed_steps: Callable[[], list[int]]
    is_backup: Callable[[int], bool] = lambda step: False
    stop_request: Callable[[], dict | None] = lambda: None
    trainer_alive: Callable[[], bool] = lambda: False
    export: Callable[[EvalResult], Any] | None = None
    where: str = ""
    storage: Any = None
    every_checkpoint: bool = True
    once: bool = False
    start_delay_secs: float = 0.0
    throttle_secs: float = 0.0
    wait_for_first_checkpoint_secs: float = FIRST_CHECKPOINT_WAIT_SECS
    poll_secs: float = EVAL_POLL_SECS
    idle_timeout_secs: float | None = None
    log: Callable[..., None] = logger.info
    warn: Callable[..., None] = logger.warning
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    evaluated: list[int] = dataclasses.field(default_factory=list, init=False)
    last: EvalResult | None = dataclasses.field(default=None, init=False)
    stopped: str | None = dataclasses.field(default=None, init=False)

    def __post_init__(self) -> None:
        self._resume_only: set[int] = set()  # preemption checkpoints and backups: never evaluated
        self._regular: set[int] = set()  # steps known not to be backups
        self._last_eval_at: float | None = None
        self._said_waiting = False  # (for a stopped job's last checkpoint: said once)

    @classmethod
    def for_job(
        cls,
        config: JobConfig,
        evaluate: Callable[[int], EvalResult],
        export: Callable[[EvalResult], Any] | None = None,
        **options: Any,
    ) -> Evaluator:
        """An evaluator of `config`'s job on its storage, with the eval spec's start delay and
        throttle; `export` only where the eval spec has exporters. `options`: the other fields."""
        from prefect_jax.training.control import stop_requested
        from prefect_jax.training.evaluation import EvalRecords
        from prefect_jax.training.steps import job_committed_steps, job_step_is_backup
        from prefect_jax.training.storage import JobStorage

        js = JobStorage(config.storage, config.job, config.storage_options)
        return cls(
            job=config.job,
            max_steps=config.train.max_steps,
            evaluate=evaluate,
            records=EvalRecords(js, config.eval.name, writer=True),
            committed_steps=lambda: job_committed_steps(js),
            is_backup=lambda step: job_step_is_backup(js, step),
            stop_request=lambda: stop_requested(js),
            trainer_alive=lambda: trainer_alive(js),
            export=export if config.eval.exporters else None,
            where=js.remote_checkpoint_url or js.checkpoint_dir,
            storage=js,
            start_delay_secs=config.eval.start_delay_secs,
            throttle_secs=config.eval.throttle_secs,
            **options,
        )

    def wait_start_delay(self) -> None:
        """Wait `start_delay_secs` (TF's evaluator does before its first evaluation)."""
        if self.start_delay_secs:
            self.log(
                "waiting start_delay_secs=%g before the first evaluation", self.start_delay_secs
            )
            self.sleep(self.start_delay_secs)

    def no_first_checkpoint(self) -> NoFirstCheckpointError:
        """The error of a first committed checkpoint that never came; where the storage has no
        such job at all, the jobs it has (a mistyped name)."""
        return NoFirstCheckpointError(
            f"no committed checkpoint of job {self.job!r} in {self.where} after "
            f"{self.wait_for_first_checkpoint_secs:g}s{self._no_such_job()}: is the trainer "
            "running, and does it use the same storage and job name? Raise "
            "wait_for_first_checkpoint_secs (--wait-for-first-checkpoint-secs) for slow starts."
        )

    def _no_such_job(self) -> str:
        """`` (storage R has no job 'x'; jobs there: a, b)`` where that is so, else ''."""
        try:
            missing = self.storage.no_such_job_said() if self.storage is not None else None
        except Exception:  # noqa: BLE001 - unreadable: the message goes without it
            return ""
        return f" ({missing})" if missing else ""

    def wait_for_first_checkpoint(self) -> int:
        """Wait `start_delay_secs`, then for the job's first committed checkpoint (TF's
        `wait_for_session`), reading the storage only; return its newest committed step.

        Raises:
            NoFirstCheckpointError: (a TimeoutError) none came within
                `wait_for_first_checkpoint_secs`.
        """
        from prefect_jax.training.checkpoint_dirs import wait_for_new_checkpoint

        self.wait_start_delay()
        missing = self._no_such_job()
        if missing and not self.committed_steps():  # (a mistyped name, or a trainer yet to start)
            self.warn(
                "no job %r there yet%s: waiting up to %gs for its trainer's first checkpoint; is "
                "--job (or the storage) mistyped?",
                self.job,
                missing,
                self.wait_for_first_checkpoint_secs,
            )
        first = wait_for_new_checkpoint(
            self.committed_steps,
            None,
            self.wait_for_first_checkpoint_secs,
            self.poll_secs,
            self.log,
            sleep=self.sleep,
            clock=self.clock,
        )
        if first is None:
            raise self.no_first_checkpoint()
        return first

    def resume_exports(self) -> None:
        """Export the newest evaluated step again: an evaluator killed after its evaluation may
        not have written its exports (exporters keep what exists)."""
        steps = self.records.steps()
        if self.export is not None and steps:
            self.export(self.records.get(steps[-1]))

    def stop_reason(self, done: set[int] | None = None) -> tuple[str | None, bool]:
        """Why the evaluator is done before looking for new steps (the final step was evaluated,
        or the job was asked to stop), and whether the trainer's last checkpoint is evaluated
        first: a stop asked by other than an evaluation (a train hook, a person), or any stop
        of a job that trains until stopped; its trainer ends at its next checkpoint, evaluated
        before the evaluator stops (TF's local mode evaluates its last checkpoint at the end).
        An evaluation's own stop (early stopping, `should_stop_job`) ends the evaluations there.
        `done`: the evaluated steps (default: the records'). The stop request is read once."""
        from prefect_jax.training.control import asked_by_an_evaluation

        done = set(self.records.steps()) if done is None else done
        if any(is_final_step(s, self.max_steps) for s in done):
            return f"evaluated the final step ({max(done)} >= max_steps={self.max_steps})", False
        request = self.stop_request()
        if request is None:
            return None, False
        last_first = self.max_steps is None or not asked_by_an_evaluation(request)
        return f"the job was asked to stop: {request.get('reason')}", last_first

    def pending_steps(self, done: set[int] | None = None) -> list[int]:
        """The committed steps to evaluate next, oldest first (only the newest, where newer than
        every evaluated one, unless `every_checkpoint`): not evaluated (`done`, default: the
        records'), not a backup nor a preemption checkpoint. Whether a step is a backup is read
        once per step."""
        done = set(self.records.steps()) if done is None else done
        committed = self.committed_steps()
        pending = [s for s in committed if s not in done and s not in self._resume_only]
        for step in pending:  # backups are resume-only: no evaluation for them
            if step not in self._regular:
                (self._resume_only if self.is_backup(step) else self._regular).add(step)
        pending = [s for s in pending if s not in self._resume_only]
        if pending and not self.every_checkpoint:  # (TF's: the newest, if newer than the last)
            pending = [s for s in pending[-1:] if s > max(done, default=-1)]
        return pending

    def evaluate_once(self, step: int, last: bool = False) -> EvalResult:
        """Evaluate `step` (no sooner than `throttle_secs` after the previous evaluation started,
        as TF's, but for the final step and the `last` of a stopped job) and export it; an
        early-stopping result, or an eval listener that stops evaluating (TF's `before_eval` /
        `after_eval` answering False), sets `stopped`."""
        if not (last or is_final_step(step, self.max_steps)):
            wait = throttle_wait(self._last_eval_at, self.throttle_secs, self.clock())
            if wait > 0:
                self.log("waiting %g s before the next evaluation (throttle_secs)", wait)
                self.sleep(wait)
                if not self.every_checkpoint:  # TF's: the newest once the wait is over
                    newest = self.pending_steps()
                    if not newest:  # (evaluated meanwhile, by another evaluator)
                        return EvalResult(status=EvalStatus.NO_NEW_CHECKPOINT, step=step)
                    step = newest[-1]
        started = self.clock()
        result = self.evaluate(step)
        if result.status is EvalStatus.EVALUATED:
            self._last_eval_at = started
            self.evaluated.append(step)
            self.last = result
            # (the listener was asked in the evaluation; a listener's last one is exported, as
            # TF exports before it asks after_eval)
            if self.export is not None:
                self.export(result)
            if result.stop_reason:
                self.stopped = result.stop_reason
        elif result.status is EvalStatus.PREEMPTION_CHECKPOINT:
            self._resume_only.add(step)
        elif result.status is EvalStatus.MISSING_CHECKPOINT:
            self.warn("step %d was deleted by retention before it could be evaluated", step)
        if result.evaluation_stopped and self.stopped is None:
            self.stopped = result.evaluation_stopped
        return result

    def run(self) -> str:
        """Evaluate new steps as they are committed until the job is done; return why it stopped:
        the final step evaluated, a stop request, an early-stopping result, an eval listener that
        stopped evaluating, nothing new left
        (`once`), or `idle_timeout_secs` without a new checkpoint and without a live trainer."""
        last_new_at = self.clock()
        while self.stopped is None:
            done = set(self.records.steps())
            reason, last_first = self.stop_reason(done)
            if reason is not None:
                if last_first:
                    if self._awaits_last_checkpoint(last_new_at):
                        self.sleep(self.poll_secs)
                        continue
                    # Its last checkpoint is evaluated (and exported) first, as a final step is.
                    for step in self.pending_steps(done):
                        self.evaluate_once(step, last=True)
                self.stopped = self.stopped or reason
                break
            pending = self.pending_steps(done)
            if not pending:
                if self.once:
                    self.stopped = "nothing new to evaluate (once=True)"
                    break
                idle = self.idle_timeout_secs
                if (
                    idle is not None
                    and self.clock() - last_new_at > idle
                    and not self.trainer_alive()
                ):
                    # (the gap, not the timeout: a trainer that died long ago was waited for)
                    gap = self.clock() - last_new_at
                    self.stopped = (
                        f"no new checkpoint for {gap:.0f}s, and no trainer holds the job's lease "
                        f"(idle_timeout_secs={idle:g})"
                    )
                    break
                self.sleep(self.poll_secs)
                continue
            for step in pending:
                self.evaluate_once(step)
                if self.stopped is not None or not self.every_checkpoint:
                    break
            last_new_at = self.clock()  # idle counts from the end of the work, however long it took
        return self.stopped

    def _awaits_last_checkpoint(self, last_new_at: float) -> bool:
        """Whether to wait on for a stopped job's last checkpoint: its trainer still lives
        (training to it), unless `once` (what is there now) or `idle_timeout_secs` has passed
        since the last new step (a trainer hung with its lease's heartbeat beating)."""
        idle = self.idle_timeout_secs
        if self.once or (idle is not None and self.clock() - last_new_at > idle):
            return False
        if not self.trainer_alive():
            return False
        if not self._said_waiting:
            self._said_waiting = True
            self.log("the job was asked to stop: waiting for its trainer's last checkpoint")
        return True

    def summary(self) -> dict[str, Any]:
        """``evaluated`` (the steps this evaluator evaluated), ``last_step``, ``eval`` (its
        metrics) and ``stopped`` (why)."""
        last = self.last
        return {
            "evaluated": self.evaluated,
            "last_step": last.step if last else None,
            "eval": last.metrics if last else {},
            "stopped": self.stopped,
        }
