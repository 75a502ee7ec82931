"""The `evaluate_if_new` task: evaluate a committed step once, publish its results."""

from __future__ import annotations

import contextvars

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from prefect_jax.tasks.events import EVAL_EVENT, emit
from prefect_jax.tasks.live_trainer import task_trainer
from prefect_jax.tasks.publish import job_artifact_key, publisher
from prefect_jax.tasks.retries import DEFAULT_RETRIES, retry_unless_lost
from prefect_jax.training.specs import JobConfig


@task(
    name="evaluate_if_new",
    task_run_name="evaluate {step}",
    cache_policy=NO_CACHE,
    retries=DEFAULT_RETRIES.eval_retries,
    retry_delay_seconds=DEFAULT_RETRIES.retry_delay_seconds,
    retry_condition_fn=retry_unless_lost,
)
def evaluate_if_new(config: JobConfig, step: int | None = None, force: bool = False):
    """Evaluate `step` unless it was evaluated before (durable record); publish a table artifact.

    The results table (artifact ``<job>-<8 hex>-<eval name>-results``) and the event
    ``prefect-jax.eval.completed`` belong to this task run, even where the step's record is
    written later (the live step's save still in flight).

    Args:
        config: the job.
        step: the committed step to evaluate (None: the newest committed one).
        force: evaluate without the throttle (`EvalSpec.throttle_secs`); a step evaluated
            before is still not evaluated again.

    Returns:
        An `EvalResult` (EVALUATED, NO_NEW_CHECKPOINT, MISSING_CHECKPOINT, THROTTLED or
        EVALUATION_STOPPED).

    Example:
        ```python
        from prefect import flow
        from prefect_jax.tasks import evaluate_if_new, restore_or_init, train_until_checkpoint
        from prefect_jax.training.specs import JobConfig, TrainSpec

        @flow
        def train_then_evaluate():
            config = JobConfig(program="prefect_jax.examples.digits:tiny", job="tiny",
                               storage="/tmp/prefect-jax", train=TrainSpec(max_steps=20))
            step = train_until_checkpoint(config, restore_or_init(config)["step"])
            return evaluate_if_new(config, step).metrics

        train_then_evaluate()
        ```
    """
    from prefect_jax.training.evaluation import EvalStatus, as_row

    logger = get_run_logger()
    trainer = task_trainer(config)
    # This task run's context: the record may come later, from another task run (see `recorded`).
    evaluating = contextvars.copy_context()

    key = job_artifact_key(config.job, config.storage, config.eval.name, "results")

    def results_table(step: int) -> None:
        """On the publisher's thread, only for a version that is published (not one a newer
        replaced): every recorded step up to `step` (listing the records is a storage round
        trip)."""
        create_table_artifact(
            key=key,
            table=[as_row(r) for r in trainer.job.records.all() if r.step <= step],
            description=f"{config.eval.name} results of job {config.job} by global step",
        )

    def publish(result) -> None:
        # Its newest version holds every row: at most every PREFECT_JAX_UI_REFRESH_SECS.
        publisher.refresh(("table", key), results_table, result.step)
        emit(
            EVAL_EVENT,
            config,
            {
                "step": result.step,
                "eval_name": result.name,
                "metrics": result.metrics,
                "is_final": result.is_final,
                "stop_reason": result.stop_reason,
            },
        )

    def recorded(result) -> None:
        """Once the step is committed and its evaluation recorded: here, or (the live step's save
        still in flight) later, from the next train task run's loop or the export task run. The
        results artifact and the event belong to this evaluate task run either way (the Prefect
        UI shows them on it), so they are made in its context."""
        evaluating.copy().run(publish, result)

    result = trainer.evaluate_if_new(step, force=force, on_recorded=recorded)
    if result.status is EvalStatus.EVALUATED:
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items()))
        when = (
            f" (recorded once step {result.step} commits: training goes on)"
            if result.pending_commit
            else ""
        )
        logger.info("%s at step %d: %s%s", config.eval.name, result.step, metrics, when)
    else:
        why = _NOT_EVALUATED.get(result.status.value, "")
        logger.info("%s of step %s: %s%s", config.eval.name, step, result.status.value, why)
    return result


# What a status other than EVALUATED means (`EvalStatus`, by value), said beside its name (a
# Keras user read PREEMPTION_CHECKPOINT as an error)
_NOT_EVALUATED = {
    "NO_NEW_CHECKPOINT": " (evaluated before: not again)",
    "MISSING_CHECKPOINT": " (no committed checkpoint to evaluate yet)",
    "THROTTLED": " (within throttle_secs of the last evaluation: skipped)",
    "PREEMPTION_CHECKPOINT": (
        " (a checkpoint made for a preemption notice, off the checkpoint cadence: kept to resume "
        "from, not evaluated or exported, as an uninterrupted run would not have evaluated it)"
    ),
    "OTHER_PROCESS": " (process 0 evaluates the job)",
    "EVALUATION_STOPPED": " (an eval hook stopped this trainer's evaluations)",
}
