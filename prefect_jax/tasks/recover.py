"""The `recover` task: TF's `SessionManager.recover_session` (restore only, never init)."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from prefect_jax.tasks.live_trainer import task_trainer
from prefect_jax.tasks.retries import DEFAULT_RETRIES, retry_if_transient
from prefect_jax.training.specs import MAX_WAIT_SECS, RECOVERY_WAIT_SECS, JobConfig


@task(
    name="recover",
    task_run_name="recover {config.job}",
    cache_policy=NO_CACHE,
    retries=DEFAULT_RETRIES.retries,
    retry_delay_seconds=DEFAULT_RETRIES.retry_delay_seconds,
    retry_condition_fn=retry_if_transient,
)
def recover(
    config: JobConfig,
    step: int | None = None,
    wait_for_checkpoint: bool = False,
    max_wait_secs: float = MAX_WAIT_SECS,
    recovery_wait_secs: float = RECOVERY_WAIT_SECS,
    evaluates: bool = False,
) -> dict[str, Any]:
    """Restore the job's newest committed checkpoint (or `step`) in this process, or nothing.

    Mirrors `SessionManager.recover_session`: where the job has no committed checkpoint (after
    waiting up to `max_wait_secs` with `wait_for_checkpoint`, looking every
    `recovery_wait_secs`), nothing is initialised and ``restored`` is False. For the roles that
    must never make a fresh state: the evaluator and an export. It takes no lease and opens no
    MLflow run, so it runs beside the job's trainer; the state it restores is evaluated and
    exported by the tasks that follow (`evaluate_if_new`, `export`), never trained on.

    Args:
        config: the job.
        step: restore this committed step (None: the newest readable one).
        wait_for_checkpoint: wait for a first committed checkpoint.
        max_wait_secs: the longest that wait lasts.
        recovery_wait_secs: how often the wait looks.
        evaluates: the step is recovered to be evaluated: the best exporters' and early
            stopping's metrics are checked first, before anything is restored.

    Returns:
        ``{"restored": bool, "step": int | None, "checkpoint_dir": str}``

    Example:
        ```python
        from prefect import flow
        from prefect_jax.tasks import evaluate_if_new, recover
        from prefect_jax.training.specs import JobConfig, TrainSpec

        @flow
        def evaluate_newest():
            config = JobConfig(program="prefect_jax.examples.digits:tiny", job="tiny",
                               storage="/tmp/prefect-jax", train=TrainSpec(max_steps=20))
            recovered = recover(config)
            if not recovered["restored"]:
                raise ValueError("job tiny has no committed checkpoint yet: train it first")
            return evaluate_if_new(config, recovered["step"], force=True).metrics

        evaluate_newest()
        ```
    """
    logger = get_run_logger()
    trainer = task_trainer(config)
    restored, at = trainer.recover(
        step,
        wait_for_checkpoint=wait_for_checkpoint,
        max_wait_secs=max_wait_secs,
        recovery_wait_secs=recovery_wait_secs,
        evaluates=evaluates,
    )
    where = trainer.job.checkpoint_location
    if restored:
        logger.info("job %s: recovered step %d", config.job, at)
    else:
        asked = "no committed checkpoint" if step is None else f"step {step} is not committed"
        logger.info("job %s: %s in %s; nothing initialised", config.job, asked, where)
    return {"restored": restored, "step": at, "checkpoint_dir": where}
