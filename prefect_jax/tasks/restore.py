"""The `restore_or_init` task: TF's `SessionManager.prepare_session` for a job."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from prefect_jax.tasks.live_trainer import trainer_holding_the_lease
from prefect_jax.tasks.retries import DEFAULT_RETRIES, retry_if_transient
from prefect_jax.tasks.runs import (
    LINK_WAIT_SECS,
    link_runs,
    mark_dead_local_runs,
    mark_taken_over,
)
from prefect_jax.training.resume_checks import data_fingerprint_of
from prefect_jax.training.specs import MAX_WAIT_SECS, RECOVERY_WAIT_SECS, JobConfig


@task(
    name="restore_or_init",
    task_run_name="restore or init {config.job}",
    cache_policy=NO_CACHE,
    retries=DEFAULT_RETRIES.retries,
    retry_delay_seconds=DEFAULT_RETRIES.retry_delay_seconds,
    retry_condition_fn=retry_if_transient,
)
def restore_or_init(
    config: JobConfig,
    checkpoint_path: str | None = None,
    wait_for_checkpoint: bool = False,
    max_wait_secs: float = MAX_WAIT_SECS,
    recovery_wait_secs: float = RECOVERY_WAIT_SECS,
    evaluates: bool = True,
) -> dict[str, Any]:
    """Resume the job from its latest committed checkpoint, or from `checkpoint_path`, or init.

    Mirrors `SessionManager.prepare_session`: a job that has checkpoints resumes from its
    newest committed one; a new job starts from `checkpoint_path` (warm start) when given,
    else from `init`. With `wait_for_checkpoint`, waits up to `max_wait_secs` for a first
    checkpoint, logging every `recovery_wait_secs`.

    The job's MLflow run is found or created in the background while the checkpoint is restored
    and the first step compiles; where the checkpoint does not name it (the job's first run), the
    task waits for it (at most `LINK_WAIT_SECS`; not for a store that did not answer the start-up
    check) so that the run and this flow run's link to it exist before training starts.

    Args:
        config: the job.
        checkpoint_path: warm-start a new job from this checkpoint step directory.
        wait_for_checkpoint: wait for a first committed checkpoint instead of initialising.
        max_wait_secs: the longest that wait lasts.
        recovery_wait_secs: how often the wait says it is still waiting.
        evaluates: this flow run evaluates the job: a new job's best exporter and early stopping
            metrics are checked before any step (False: the `train` role, whose evaluator does).

    Returns:
        ``{"step": int, "mlflow_run_id": str | None, "checkpoint_dir": str}`` (the MLflow run
        id None while MLflow is still opening)

    Example:
        ```python
        from prefect import flow
        from prefect_jax.tasks import restore_or_init
        from prefect_jax.training.specs import JobConfig, TrainSpec

        @flow
        def resume():
            config = JobConfig(program="prefect_jax.examples.digits:tiny", job="tiny",
                               storage="/tmp/prefect-jax", train=TrainSpec(max_steps=20))
            return restore_or_init(config)["step"]

        resume()
        ```
    """
    logger = get_run_logger()
    trainer = trainer_holding_the_lease(config)
    step = trainer.restore_or_init(
        checkpoint_path=checkpoint_path,
        wait_for_checkpoint=wait_for_checkpoint,
        max_wait_secs=max_wait_secs,
        recovery_wait_secs=recovery_wait_secs,
        evaluates=evaluates,
    )
    mark_taken_over(trainer)
    mark_dead_local_runs(config)
    # MLflow opens in the background while the job restores and its first step compiles; a job's
    # first run waits here for its MLflow run (bounded), so that the run, its job tag and this
    # flow run's link exist before the first step: a run killed in its first interval is linked,
    # and its rerun writes into that run. MLflow's "Prefect flow run" is re-pointed only once
    # this flow run trains (`Job.name_this_flow_run`).
    link_runs(config, trainer.job.tracker, trains=False, wait_secs=LINK_WAIT_SECS)
    run_id = trainer.job.tracker.run_id_if_known()
    mlflow_run = run_id or "opening (its link is added to this flow run once MLflow answers)"
    on = f"; training on {trainer.trains_on}" if trainer.trains_on else ""
    try:  # (a detail of this line: a program's failure to answer is said by its next save)
        data = data_fingerprint_of(trainer.program) if trainer.trains_on else None
    except Exception:  # noqa: BLE001
        data = None
    on += f"; data {data}" if data else ""
    logger.info(
        "job %s at step %d (%s)%s; MLflow run %s",
        config.job,
        step,
        "restored" if step else "initialised",
        on,
        mlflow_run,
    )
    return {
        "step": step,
        "mlflow_run_id": run_id,
        "checkpoint_dir": trainer.job.checkpoint_location,
    }
