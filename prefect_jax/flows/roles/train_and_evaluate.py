"""The `train_and_evaluate` flow: TensorFlow's `train_and_evaluate` in local mode."""

# No `from __future__ import annotations`: see prefect_jax/flows/__init__.py.
from typing import Any

from prefect import flow, get_run_logger

from prefect_jax.flows.config import ProgramPath, checked_job_config
from prefect_jax.flows.hooks import end_the_job
from prefect_jax.flows.processes import join_processes
from prefect_jax.flows.retry_options import job_tasks
from prefect_jax.flows.tags import flow_body
from prefect_jax.flows.task_loop import job_summary, train_loop
from prefect_jax.training.specs import CheckpointSpec, EvalSpec, RetrySpec, TrainSpec


@flow(
    name="train_and_evaluate",
    flow_run_name="train-and-evaluate-{job}",
    on_failure=[end_the_job("FAILED")],
    on_crashed=[end_the_job("KILLED")],
    validate_parameters=True,
)
@flow_body
def train_and_evaluate(
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
    """Train until `train_spec.max_steps`, evaluating and exporting every new checkpoint.

    TensorFlow's `train_and_evaluate` in local mode, as Prefect tasks: restore-or-init,
    then train-until-checkpoint / evaluate-if-new / export until `max_steps` (or until early
    stopping or an eval hook's `should_stop_job` asks the job to stop). An eval listener whose
    `before_eval` / `after_eval` answers False (TF's `_ContinuousEvalListener`) ends the
    evaluations and exports, not the training, which goes on to `max_steps`. Running it again on
    the same job resumes at the last committed checkpoint: no step is retrained, no step
    evaluated twice, and the same MLflow run is continued.

    Args:
        program: import path of the program, ``"package.module:attribute"``.
        job: job name; files live under ``<storage>/<job>/``.
        storage: storage root: a local directory or any fsspec URL (``s3://``, ``gs://``...), or
            ``"jax-checkpoint-storage/<block name>"`` for a saved `CheckpointStorage` block.
        train_spec: how long to train.
        eval_spec: how to evaluate, the exporters, early stopping.
        checkpoint_spec: checkpoint cadence and retention.
        mlflow_tracking_uri: MLflow tracking URI (default: ``MLFLOW_TRACKING_URI`` or
            ``sqlite:///mlflow.db``), or ``"prefect-jax-mlflow-tracking/<block name>"`` for a
            saved `MlflowTracking` block (its URI, and its experiment unless
            `mlflow_experiment` is given).
        mlflow_experiment: MLflow experiment name (default: the tracking block's experiment,
            else ``prefect-jax``); given, it wins over a block's, even as ``prefect-jax``.
        checkpoint_path: warm-start a new job from this checkpoint step directory (ignored
            once the job has checkpoints of its own).
        compilation_cache_dir: JAX persistent compilation cache directory, or ``"job"`` for
            one under the job's storage: a resumed run does not recompile.
        retry_spec: how often the tasks retry a transient failure.
        program_params: the program's typed parameters (a dict of its factory's parameter
            type's fields, see docs/program.md); recorded in checkpoints and MLflow params
            ``program.<field>``, and a resume with other values is refused.
        mlflow_optional: a tracking URI that MLflow cannot use or reach is a warning, not a
            failure before any work.

    Returns:
        A summary (`flows.task_loop`'s, shared with `train`): ``job``, ``final_step``, ``eval``
        (final metrics), ``checkpoint_dir``, ``mlflow_tracking_uri``, ``mlflow_run_id``,
        ``mlflow_run_url``, ``registered_model`` (None without exporters), ``exports``,
        ``state_fingerprint``, ``stopped`` (why the job stopped early, or None),
        ``evaluation_stopped`` (why an eval listener stopped the evaluations, or None: training
        went on to ``max_steps``), ``goodput`` (the job's ledger, as `status` shows it) and
        ``mlflow_missing`` (what of the job did not reach MLflow, or None), ``registry_missing``
        (exports MLflow did not take as versions, and the command that registers them; or None).

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
    config = checked_job_config(locals())  # its MLflow URI checked before any work
    join_processes()
    step = job_tasks(config.retry).restore_or_init(config, checkpoint_path=checkpoint_path)["step"]
    step, stopped = train_loop(config, step, evaluate=True)
    summary = job_summary(config, stopped, evaluates=True)
    why = f" (stopped: {stopped})" if stopped else ""
    get_run_logger().info(
        "job %s done at step %d: %s%s", job, summary["final_step"], summary["eval"], why
    )
    return summary
