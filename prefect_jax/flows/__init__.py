"""Prefect flows: `train_and_evaluate` (TF's local mode).

Every parameter is JSON-able (a program import path, names, a URL and pydantic specs), so
the flow deploys as is: ``prefect deploy`` or ``train_and_evaluate.serve(...)``.

Example:
    ```python
    from prefect_jax.flows import train_and_evaluate
    from prefect_jax.training.specs import CheckpointSpec, EvalSpec, TrainSpec

    summary = train_and_evaluate(
        program="prefect_jax.examples.digits:program",
        job="digits",
        storage="/tmp/prefect-jax",
        train_spec=TrainSpec(max_steps=1000),
        checkpoint_spec=CheckpointSpec(every_steps=200),
        eval_spec=EvalSpec(),
    )
    print(summary["eval"])
    ```
"""

# No `from __future__ import annotations` here: `serve` sends the flow to its child process
# with cloudpickle, which copies only the globals the function's code uses; string
# annotations would leave TrainSpec & co. unresolvable there and every served run would fail
# parameter validation (tests/test_deployment_rerun.py).
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from prefect_jax.tasks import evaluate_if_new, export, restore_or_init, train_until_checkpoint
from prefect_jax.training.specs import CheckpointSpec, EvalSpec, JobConfig, TrainSpec


def _config_from(parameters: dict[str, Any]) -> JobConfig | None:
    try:
        return _job_config(**{k: parameters[k] for k in _CONFIG_ARGS if k in parameters})
    except Exception:  # noqa: BLE001 - a hook must not raise over bad parameters
        return None


def _close_mlflow_run(status: str):
    def hook(flow, flow_run, state):
        from prefect_jax.training.trainer import _live

        config = _config_from(flow_run.parameters)
        if config is None:
            return
        from prefect_jax.training.storage import JobStorage

        trainer = _live.get(JobStorage(config.storage, config.job).job_dir)
        if trainer is not None and trainer.lease.held:  # never touch a job another trainer holds
            # Let a checkpoint in flight commit (no step lost), close the MLflow run, free the lease.
            trainer.finish(status)

    return hook


_CONFIG_ARGS = (
    "program",
    "job",
    "storage",
    "train_spec",
    "eval_spec",
    "checkpoint_spec",
    "mlflow_tracking_uri",
    "mlflow_experiment",
    "compilation_cache_dir",
)


def _job_config(
    program: str,
    job: str,
    storage: str,
    train_spec: TrainSpec | dict,
    eval_spec: EvalSpec | dict | None = None,
    checkpoint_spec: CheckpointSpec | dict | None = None,
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str = "prefect-jax",
    compilation_cache_dir: str | None = None,
) -> JobConfig:
    return JobConfig(
        program=program,
        job=job,
        storage=storage,
        train=train_spec,
        eval=eval_spec or EvalSpec(),
        checkpoint=checkpoint_spec or CheckpointSpec(),
        mlflow_tracking_uri=mlflow_tracking_uri,
        mlflow_experiment=mlflow_experiment,
        compilation_cache_dir=compilation_cache_dir,
    )


@flow(
    name="train_and_evaluate",
    flow_run_name="train-and-evaluate-{job}",
    on_failure=[_close_mlflow_run("FAILED")],
    on_crashed=[_close_mlflow_run("KILLED")],
    validate_parameters=True,
)
def train_and_evaluate(
    program: str,
    job: str,
    storage: str,
    train_spec: TrainSpec,
    eval_spec: EvalSpec = EvalSpec(),
    checkpoint_spec: CheckpointSpec = CheckpointSpec(),
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str = "prefect-jax",
    checkpoint_path: str | None = None,
    compilation_cache_dir: str | None = None,
) -> dict[str, Any]:
    """Train until `train_spec.max_steps`, evaluating and exporting every new checkpoint.

    TensorFlow's `train_and_evaluate` in local mode, as Prefect tasks: restore-or-init,
    then train-until-checkpoint / evaluate-if-new / export until `max_steps`. Running it
    again on the same job resumes at the last committed checkpoint: no step is retrained,
    no step evaluated twice, and the same MLflow run is continued.

    Args:
        program: import path of the program, ``"package.module:attribute"``.
        job: job name; files live under ``<storage>/<job>/``.
        storage: storage root: a local directory (``gs://`` too).
        train_spec: how long to train.
        eval_spec: how to evaluate, and the exporters.
        checkpoint_spec: checkpoint cadence and retention.
        mlflow_tracking_uri: MLflow tracking URI (default: ``MLFLOW_TRACKING_URI`` or
            ``sqlite:///mlflow.db``).
        mlflow_experiment: MLflow experiment name.
        checkpoint_path: warm-start a new job from this checkpoint step directory (ignored
            once the job has checkpoints of its own).
        compilation_cache_dir: JAX persistent compilation cache directory, or ``"job"`` for
            one under the job's storage: a resumed run does not recompile.

    Returns:
        A summary: ``job``, ``final_step``, ``eval`` (final metrics), ``checkpoint_dir``,
        ``mlflow_tracking_uri``, ``mlflow_run_id``, ``exports``, ``state_fingerprint``.
    """
    from prefect_jax.training.exporters import list_exports
    from prefect_jax.training.trainer import get_trainer

    logger = get_run_logger()
    config = _job_config(
        program,
        job,
        storage,
        train_spec,
        eval_spec,
        checkpoint_spec,
        mlflow_tracking_uri,
        mlflow_experiment,
        compilation_cache_dir,
    )
    max_steps = config.train.max_steps
    started = restore_or_init(config, checkpoint_path=checkpoint_path)
    step = started["step"]
    progress = create_progress_artifact(
        progress=100.0 * min(step, max_steps) / max_steps,
        description=f"training {job}: step {step} of {max_steps}",
    )
    if step > 0:
        # A crash between a checkpoint and its evaluation leaves that step unevaluated.
        result = evaluate_if_new(config, step)
        export(config, result)
    while step < max_steps:
        step = train_until_checkpoint(config, step)
        update_progress_artifact(progress, 100.0 * step / max_steps, description=f"training {job}: step {step} of {max_steps}")
        result = evaluate_if_new(config, step)
        export(config, result)

    trainer = get_trainer(config)
    if trainer.state is None:
        trainer.restore_or_init()
    trainer.finish("FINISHED")
    final = trainer.records.get(trainer.step)
    summary = {
        "job": job,
        "final_step": trainer.step,
        "eval": final.metrics if final else {},
        "checkpoint_dir": trainer.checkpoints.directory,
        "mlflow_tracking_uri": trainer.tracker.tracking_uri,
        "mlflow_run_id": trainer.tracker.run_id,
        "exports": list_exports(trainer.storage),
        "state_fingerprint": trainer.fingerprint(),
    }
    logger.info("job %s done at step %d: %s", job, trainer.step, summary["eval"])
    return summary


__all__ = ["train_and_evaluate"]
