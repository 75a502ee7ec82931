"""The `export` task: run the eval spec's exporters on an evaluated step."""

from __future__ import annotations

import contextvars

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from prefect_jax.tasks.events import EXPORT_EVENT, emit
from prefect_jax.tasks.live_trainer import task_trainer
from prefect_jax.tasks.retries import DEFAULT_RETRIES, retry_unless_lost
from prefect_jax.training.specs import JobConfig


@task(
    name="export",
    task_run_name="export {result.step}",
    cache_policy=NO_CACHE,
    retries=DEFAULT_RETRIES.eval_retries,
    retry_delay_seconds=DEFAULT_RETRIES.retry_delay_seconds,
    retry_condition_fn=retry_unless_lost,
)
def export(config: JobConfig, result, background: bool = False) -> dict[str, str]:
    """Run the eval spec's exporters on an evaluated result.

    Serving artifacts under ``<job>/exports/<exporter>/<step>/``, MLflow models and registry
    aliases (`EvalSpec.exporters`, `EvalSpec.registered_model`); exports already written are
    kept. Emits ``prefect-jax.export.completed`` when anything was written.

    Args:
        config: the job.
        result: the step's `EvalResult` (what `evaluate_if_new` returned).
        background: lower and write on a thread while training goes on (the train flows);
            the next export and the job's end wait for it, and fail if it failed
            (`Trainer.export_in_background`). Its log lines and event come once it is written.

    Returns:
        ``{exporter: export dir}`` of what was written (in the background: ``{}``).

    Example:
        ```python
        from prefect import flow
        from prefect_jax.tasks import evaluate_if_new, export, restore_or_init
        from prefect_jax.tasks import train_until_checkpoint
        from prefect_jax.training.specs import EvalSpec, JobConfig, LatestExporter, TrainSpec

        @flow
        def train_evaluate_export():
            config = JobConfig(program="prefect_jax.examples.digits:tiny", job="tiny",
                               storage="/tmp/prefect-jax", train=TrainSpec(max_steps=20),
                               eval=EvalSpec(exporters=[LatestExporter()]))
            step = train_until_checkpoint(config, restore_or_init(config)["step"])
            return export(config, evaluate_if_new(config, step))

        train_evaluate_export()
        ```
    """
    logger = get_run_logger()

    # In the background its lines come after this task run's "Finished": they say why.
    when = " (written in the background while training went on)" if background else ""

    def announce(written: dict[str, str]) -> None:
        for name, path in written.items():
            logger.info("exporter %s: %s%s", name, path, when)
        if written:
            emit(EXPORT_EVENT, config, {"step": result.step, "exports": written})

    if background:
        # (the run context, for the event and the log lines, on the export's thread)
        context = contextvars.copy_context()
        task_trainer(config).export_in_background(
            result, on_done=lambda written: context.run(announce, written)
        )
        return {}
    written = task_trainer(config).export(result)
    announce(written)
    return written
