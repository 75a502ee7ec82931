"""Prefect tasks over the engine: restore_or_init, recover, train_until_checkpoint, evaluate_if_new,
export.

Each task passes small references (the JSON-able `JobConfig`, a step, an `EvalResult`),
never arrays. The live train state stays in this process between tasks of one flow run
(see `prefect_jax.training.live`); a retry or another process restores
from storage.

Example:
    ```python
    from prefect import flow
    from prefect_jax.tasks import restore_or_init, train_until_checkpoint, evaluate_if_new
    from prefect_jax.training.specs import JobConfig, TrainSpec

    @flow
    def my_loop(config: JobConfig):
        step = restore_or_init(config)["step"]
        while step < config.train.max_steps:
            step = train_until_checkpoint(config, step)
            evaluate_if_new(config, step)
    ```
"""

from prefect_jax.tasks.evaluate import evaluate_if_new
from prefect_jax.tasks.events import CHECKPOINT_EVENT, EVAL_EVENT, EXPORT_EVENT, emit, job_resource
from prefect_jax.tasks.export import export
from prefect_jax.tasks.live_trainer import (
    take_the_lease_before_jax,
    task_trainer,
    trainer_holding_the_lease,
)
from prefect_jax.tasks.publish import (
    UI_REFRESH_SECS,
    artifact_key,
    job_artifact_key,
    publisher,
    ui_refresh_secs,
)
from prefect_jax.tasks.recover import recover
from prefect_jax.tasks.restore import restore_or_init
from prefect_jax.tasks.retries import DEFAULT_RETRIES, retry_if_transient, retry_unless_lost
from prefect_jax.tasks.runs import (
    link_runs,
    mark_dead_local_runs,
    mark_taken_over,
    prefect_flow_run_url,
    process_tag,
)
from prefect_jax.tasks.train import train_until_checkpoint

__all__ = [
    "CHECKPOINT_EVENT",
    "DEFAULT_RETRIES",
    "EVAL_EVENT",
    "EXPORT_EVENT",
    "UI_REFRESH_SECS",
    "take_the_lease_before_jax",
    "task_trainer",
    "trainer_holding_the_lease",
    "artifact_key",
    "job_artifact_key",
    "emit",
    "evaluate_if_new",
    "export",
    "job_resource",
    "link_runs",
    "mark_dead_local_runs",
    "mark_taken_over",
    "prefect_flow_run_url",
    "process_tag",
    "publisher",
    "recover",
    "restore_or_init",
    "retry_if_transient",
    "retry_unless_lost",
    "train_until_checkpoint",
    "ui_refresh_secs",
]
