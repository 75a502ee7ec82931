"""The `export` flow: the exporters on an evaluated step, on demand."""

# No `from __future__ import annotations`: see prefect_jax/flows/__init__.py.
from typing import Any

from prefect import flow, get_run_logger

from prefect_jax.flows.config import (
    PeriodSecs,
    ProgramPath,
    WaitSecs,
    checked_job_config,
    following_the_trainer,
)
from prefect_jax.flows.retry_options import job_tasks
from prefect_jax.flows.tags import flow_body
from prefect_jax.training.specs import (
    MAX_WAIT_SECS,
    RECOVERY_WAIT_SECS,
    CheckpointSpec,
    EvalSpec,
    RetrySpec,
    TrainSpec,
)


@flow(name="export", flow_run_name="export-{job}", validate_parameters=True)
@flow_body
def export_flow(
    program: ProgramPath,
    job: str,
    storage: str,
    train_spec: TrainSpec,
    eval_spec: EvalSpec = EvalSpec(),
    checkpoint_spec: CheckpointSpec = CheckpointSpec(),
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str | None = None,
    step: int | None = None,
    retry_spec: RetrySpec = RetrySpec(),
    program_params: dict[str, Any] | None = None,
    wait_for_checkpoint: bool = False,
    max_wait_secs: WaitSecs = MAX_WAIT_SECS,
    recovery_wait_secs: PeriodSecs = RECOVERY_WAIT_SECS,
    mlflow_optional: bool = False,
) -> dict[str, str]:
    """Run the eval spec's exporters on an evaluated step (default: the newest evaluated one).

    The step's checkpoint is restored with the `recover` task (TF's `recover_session`): a job
    without checkpoints, or a step whose checkpoint is gone, ends with an error that says so,
    and nothing is initialised. Exports already written are kept as they are. With
    `wait_for_checkpoint` (TF's `recover_session` wait), a job with no evaluated step yet (or
    without `step`) is waited for, up to `max_wait_secs`, looking every `recovery_wait_secs`,
    before that error. The other parameters are `train_and_evaluate`'s.

    Returns:
        ``{exporter: export dir}`` of the step, written now or by an earlier run.

    Example:
        ```python
        from prefect_jax.flows import export_flow
        from prefect_jax.training.specs import EvalSpec, LatestExporter, TrainSpec

        exports = export_flow(
            program="prefect_jax.examples.digits:tiny",
            job="tiny",
            storage="/tmp/prefect-jax",
            train_spec=TrainSpec(max_steps=40),
            eval_spec=EvalSpec(exporters=[LatestExporter()]),
        )
        print(exports)
        ```
    """
    from prefect_jax.training.evaluation import EvalRecords
    from prefect_jax.training.export_choice import (
        checkpoint_gone,
        export_refusal,
        why_not_exported,
    )
    from prefect_jax.training.live import land_mlflow_writes, release_state
    from prefect_jax.training.storage import JobStorage

    config = checked_job_config(locals())  # its MLflow URI checked before any work
    js = JobStorage(config.storage, config.job, config.storage_options)
    records = EvalRecords(js, config.eval.name)
    steps = records.steps()
    if wait_for_checkpoint:
        steps = _wait_for_evaluated(records, step, max_wait_secs, recovery_wait_secs)
    tasks = job_tasks(config.retry)
    waited = f" (waited max_wait_secs={max_wait_secs:g})" if wait_for_checkpoint else ""
    refusal = export_refusal(js, records, step, steps, waited)
    if refusal is not None:  # (the command refused it already, where it came through one)
        raise ValueError(refusal)
    chosen = steps[-1] if step is None else step
    result = records.get(chosen)  # (read by the check)
    # (the final exporter's "final" is the trainer's max_steps, as the evaluator's: its newest
    # step's, which a rerun may have raised since `chosen` was saved)
    from prefect_jax.training.steps import job_committed_steps

    newest = max(job_committed_steps(js), default=chosen)
    config = following_the_trainer(config, js, newest, "export", get_run_logger().info)
    # TF's recover_session: the step's own checkpoint, never a fresh state in its place
    if not tasks.recover(config, step=chosen)["restored"]:
        raise ValueError(checkpoint_gone(js, chosen))  # (removed since the check)
    tasks.export(config, result)  # (what it writes now: its log lines and event)
    from prefect_jax.tasks.runs import link_live_job

    link_live_job(config)  # this flow run and the job's MLflow run name each other
    land_mlflow_writes(config)  # the model versions too
    release_state(config)
    # the step's exports, whichever run wrote them
    dirs = {e.name: js.export_dir(e.name, chosen) for e in config.eval.exporters}
    written = {name: path for name, path in dirs.items() if js.fs.exists(path)}
    # (an exporter that skips a step it does not export, best's or final's, is what the others'
    # writing it expects: said plainly; a warning only where no exporter wrote the step)
    say = get_run_logger().info if written else get_run_logger().warning
    for exporter in config.eval.exporters:
        if exporter.name not in written:
            try:
                why = why_not_exported(exporter, js, result, config.train.max_steps)
            except Exception as exc:  # noqa: BLE001 - an explanation: never the flow's failure
                why = f"not known ({exc!r})"
            say("exporter %s wrote nothing: %s", exporter.name, why)
    return written


def _wait_for_evaluated(records, step, max_wait_secs: float, every_secs: float) -> list[int]:
    """The evaluated steps once there is one (or `step` is among them), or when the wait ends."""
    import threading
    import time

    from prefect_jax.training.trainer_thread import wait_in_slices

    logger = get_run_logger()
    deadline = time.monotonic() + max_wait_secs
    while True:
        steps = records.steps()
        if (step is None and steps) or step in steps:
            return steps
        left = deadline - time.monotonic()
        if left <= 0:
            logger.warning("no evaluated step to export within max_wait_secs=%g", max_wait_secs)
            return steps
        logger.info("waiting for an evaluated step to export (%.0f s left)", left)
        # (in slices: a signal the kernel hands to another thread still ends the wait at once)
        wait_in_slices(threading.Event().wait, min(every_secs, left))
