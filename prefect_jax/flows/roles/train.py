"""The `train` flow: the trainer role, checkpoints only (evaluation is the `evaluate` flow's)."""

# No `from __future__ import annotations`: see prefect_jax/flows/__init__.py.
from typing import Any

from prefect import flow, get_run_logger

from prefect_jax.flows.config import ProgramPath, checked_job_config
from prefect_jax.flows.hooks import end_the_job
from prefect_jax.flows.processes import join_processes
from prefect_jax.flows.retry_options import job_tasks
from prefect_jax.flows.tags import flow_body
from prefect_jax.flows.task_loop import job_summary, train_loop
from prefect_jax.training.policy import CheckpointPolicy
from prefect_jax.training.specs import CheckpointSpec, EvalSpec, RetrySpec, TrainSpec


@flow(
    name="train",
    flow_run_name="train-{job}",
    on_failure=[end_the_job("FAILED")],
    on_crashed=[end_the_job("KILLED")],
    validate_parameters=True,
)
@flow_body
def train(
    program: ProgramPath,
    job: str,
    storage: str,
    train_spec: TrainSpec,
    eval_spec: EvalSpec = EvalSpec(),
    checkpoint_spec: CheckpointSpec = CheckpointSpec(),
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str | None = None,
    checkpoint_path: str | None = None,
    compilation_cache_dir: str | None = None,
    retry_spec: RetrySpec = RetrySpec(),
    program_params: dict[str, Any] | None = None,
    mlflow_optional: bool = False,
) -> dict[str, Any]:
    """The trainer role: train and checkpoint until `max_steps`; evaluation is someone else's.

    Emits ``prefect-jax.checkpoint.committed`` (resource ``prefect-jax.job.<job>.<hash>`` of
    storage + job, see `prefect_jax.deployments.job_resource_id`; the step in the payload) for
    each committed checkpoint (not for backups, which nobody evaluates:
    `CheckpointSpec.backups`), so an evaluator deployment can be triggered by events instead of
    polling. Stops early when the job is asked to stop (``<job>/stop.json``, written by the
    evaluator's early-stopping hook). Parameters as `train_and_evaluate`: `eval_spec` is the
    evaluator's, recorded in MLflow params, and its exporters' ``serve`` and ``compare_fn`` are
    checked here before any work (an evaluator finding them broken would find it after training).

    Returns:
        The summary `train_and_evaluate` returns.

    Example:
        ```python
        from prefect_jax.flows import train
        from prefect_jax.training.specs import CheckpointSpec, TrainSpec

        summary = train(
            program="prefect_jax.examples.digits:tiny",
            job="tiny",
            storage="/tmp/prefect-jax",
            train_spec=TrainSpec(max_steps=40),
            checkpoint_spec=CheckpointSpec(every_steps=20),
        )
        print(summary["final_step"])
        ```
    """
    # The evaluator runs elsewhere: retention keeps the steps it has not reached yet.
    checkpoint_spec = CheckpointPolicy.spec_for_role(
        CheckpointSpec.model_validate(checkpoint_spec), "train"
    )
    config = checked_job_config(locals())  # its MLflow URI checked before any work
    join_processes()
    tasks = job_tasks(config.retry)
    # (its eval metrics are the evaluator's to check, as `prefect-jax train` leaves them)
    step = tasks.restore_or_init(config, checkpoint_path=checkpoint_path, evaluates=False)["step"]
    step, stopped = train_loop(config, step, evaluate=False)
    summary = job_summary(config, stopped)
    why = f" (stopped: {stopped})" if stopped else ""
    get_run_logger().info("trainer of %s done at step %d%s", job, summary["final_step"], why)
    return summary
