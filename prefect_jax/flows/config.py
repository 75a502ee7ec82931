"""A flow's parameters as the job's `JobConfig`."""

# No `from __future__ import annotations`: see prefect_jax/flows/__init__.py.
import json
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from prefect_jax.tasks import ui_refresh_secs
from prefect_jax.training.names import DEFAULT_EXPERIMENT
from prefect_jax.training.specs import CheckpointSpec, EvalSpec, JobConfig, RetrySpec, TrainSpec

# The roles' waits as flow parameters: the flow's validation and the deployment's schema refuse
# a negative one (it was taken as 0, or failed in `time.sleep` after the evaluations), and a
# period of 0 (a poll that spins).
WaitSecs = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PeriodSecs = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def _import_path(value: Any) -> Any:
    if isinstance(value, str):
        return value
    raise ValueError(
        f"{value!r} is not an import path: give the program as 'package.module:attribute' where "
        "it is defined (a flow's parameters travel as JSON, so the program is found by its path), "
        "e.g. 'prefect_jax.examples.digits:program'"
    )


# A flow's `program`: a program object given from Python is refused naming the fix (pydantic said
# only "Input should be a valid string").
ProgramPath = Annotated[str, BeforeValidator(_import_path)]

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
    "retry_spec",
    "program_params",
)


def _job_config(
    program: str,
    job: str,
    storage: str,
    train_spec: TrainSpec | dict,
    eval_spec: EvalSpec | dict | None = None,
    checkpoint_spec: CheckpointSpec | dict | None = None,
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str | None = None,
    compilation_cache_dir: str | None = None,
    retry_spec: RetrySpec | dict | None = None,
    check_settings: bool = True,
    program_params: dict[str, Any] | None = None,
) -> JobConfig:
    """The job's `JobConfig` from a flow's parameters (the specs as given or as their dicts)."""
    from prefect_jax.blocks import resolve_storage, resolve_tracking

    if check_settings:  # (not in a state hook: it must find the job to close its MLflow run)
        ui_refresh_secs()  # a bad PREFECT_JAX_UI_REFRESH_SECS fails here, before anything runs
    url, options = resolve_storage(storage)
    if check_settings:  # (a state hook finds the job's live trainer, whose tracker has the URI)
        mlflow_tracking_uri, mlflow_experiment = resolve_tracking(
            mlflow_tracking_uri, mlflow_experiment
        )
    return JobConfig(
        program=program,
        job=job,
        storage=url,
        storage_name=storage if storage != url else None,
        storage_options=options,
        train=train_spec,
        eval=eval_spec or EvalSpec(),
        checkpoint=checkpoint_spec or CheckpointSpec(),
        mlflow_tracking_uri=mlflow_tracking_uri,
        # (the default's one home: given, else a tracking block's, else this)
        mlflow_experiment=mlflow_experiment or DEFAULT_EXPERIMENT,
        compilation_cache_dir=compilation_cache_dir,
        retry=retry_spec or RetrySpec(),
        program_params=program_params,
    )


def checked_job_config(parameters: dict[str, Any]) -> JobConfig:
    """The job of a flow's own parameters (its ``locals()`` as its body starts), its MLflow
    tracking URI (a block's, resolved; else ``MLFLOW_TRACKING_URI``'s) checked: an unusable one
    is refused before any work (``mlflow_optional``: a warning)."""
    from prefect_jax.training.facade import check_flow_tracking_uri
    from prefect_jax.training.preflight import check_compilation_cache

    config = _job_config(**{k: parameters[k] for k in _CONFIG_ARGS if k in parameters})
    check_compilation_cache("compilation_cache_dir", config.compilation_cache_dir)
    given = bool(parameters.get("mlflow_tracking_uri"))
    check_flow_tracking_uri(config.mlflow_tracking_uri, parameters.get("mlflow_optional"), given)
    return config


def config_from(parameters: dict[str, Any]) -> JobConfig | None:
    """The job of a flow run's `parameters`, or None where they do not make one (a state hook's)."""
    try:
        given = {k: parameters[k] for k in _CONFIG_ARGS if k in parameters}
        return _job_config(**given, check_settings=False)
    except Exception:  # noqa: BLE001 - a hook must not raise over bad parameters
        return None


def following_the_trainer(config: JobConfig, storage, step: int, role: str, log) -> JobConfig:
    """`config` with what its trainer recorded in `step` (`JobStorage` `storage`): its max_steps,
    and the program params it was given under `config`'s own. The roles that do not train (the
    evaluator, the exporter) follow it (`prefect_jax.training.following`)."""
    from prefect_jax.training.following import trainers_max_steps, trainers_program_params
    from prefect_jax.training.steps import step_meta

    meta = step_meta(storage, step)
    max_steps = trainers_max_steps(meta, config.train.max_steps)
    params, taken = trainers_program_params(meta, config.program_params)
    update: dict[str, Any] = {}
    if max_steps != config.train.max_steps:
        log(
            "job %s's trainer trains to max_steps=%s (its step %d records it): this %s follows "
            "it, not the max_steps=%s of its own train_spec (--max-steps)",
            config.job,
            max_steps,
            step,
            role,
            config.train.max_steps,
        )
        update["train"] = config.train.model_copy(update={"max_steps": max_steps})
    if params != config.program_params:
        log(
            "job %s's trainer was given program params %s (its step %d records them): this %s "
            "builds its program with them%s",
            config.job,
            json.dumps(taken, sort_keys=True),
            step,
            role,
            f" and its own {json.dumps(config.program_params)}" if config.program_params else "",
        )
        update["program_params"] = params
    return config.model_copy(update=update) if update else config
