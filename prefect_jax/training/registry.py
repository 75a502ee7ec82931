"""Exports as MLflow Models in the Model Registry.

Each exported step becomes one MLflow Model (the pyfunc of `pyfunc_model.py` around the
export's ``model.jax_export``, with a signature and an input example), logged to the job's run
at its step, and one version of the job's registered model. Exporters move aliases to those
versions: ``best``, ``final``, and ``newest`` for the ``latest`` exporter (MLflow reserves the
alias ``latest``; ``models:/<name>/latest`` is its highest version). Versions are found again
by their tags (job, step), so a rerun never registers a step twice; a model logged by a process
killed before it registered the version is found by the same tags and registered then.

Everything here runs on the `Tracker`'s MLflow thread, with its client.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import uuid
from collections.abc import Callable
from typing import Any

from prefect_jax.training.names import (
    CREATE_TAG,
    EXPORT_INFO_FILE,
    JOB_TAG,
    MODEL_FILE,
    RESERVED_ALIASES,
    STEP_TAG,
)
from prefect_jax.training.registry_search import (
    job_versions,
    logged_model_of_step,
    one_logged_model,
    one_version,
)
from prefect_jax.training.registry_signature import export_signature, typed_example
from prefect_jax.training.storage import job_digest

logger = logging.getLogger("prefect_jax.registry")


class _NoPipVersionWarning(logging.Filter):
    """MLflow warns on every model that a uv environment has no pip to name in conda.yaml: noise
    here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to resolve installed pip version" not in record.getMessage()


logging.getLogger("mlflow.utils.environment").addFilter(_NoPipVersionWarning())

PYFUNC_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyfunc_model.py")


def default_registered_model(job: str, storage_root: str) -> str:
    """The registered model of a job that names none: ``<job>-<8 hex digits>``, the digits a hash
    of the job's storage root (credentials redacted) and the job. Two jobs of one name on two
    storages (a second ``digits``) never become versions of one model, so ``models:/<name>@best``
    always loads this job's own model. `EvalSpec.registered_model` (``--registered-model``)
    chooses a name instead."""
    return f"{job}-{job_digest(storage_root, job)[:8]}"


def registered_model_of(given: str | None, job: str, storage_root: str) -> str | None:
    """The registered model of a job's exports: `given` (`EvalSpec.registered_model`), else
    `default_registered_model`; None where `given` is ``""`` (nothing registered)."""
    if given is None:
        return default_registered_model(job, storage_root)
    return given or None


ALIASES_DESCRIPTION = (
    "`@best` (the best recorded evaluation, the `best` exporter), `@final` (the step at or past "
    "`max_steps`, the `final` exporter), `@newest` (the newest export, the `latest` exporter: "
    "MLflow reserves `latest`)"
)


def logged_model_name(job: str, step: int) -> str:
    """The name of a step's MLflow Model: ``<job>-step-<step>``, with each character MLflow
    refuses in it (``/ : . % " '``; a sweep's job ``lm-lr0.001``) as ``-``. Found by its tags,
    never by this name."""
    return re.sub(r"[/:.%\"']", "-", job) + f"-step-{step}"


def alias_for(exporter_name: str) -> str:
    """The registry alias an exporter moves: its name (``latest`` is reserved by MLflow:
    ``newest``)."""
    reserved = RESERVED_ALIASES.get(exporter_name.lower())
    if reserved is not None:
        return reserved
    return exporter_name.replace(".", "-")


def requirements() -> list[str]:
    """What the pyfunc needs to load: exact versions of JAX, jaxlib and NumPy (MLflow adds
    itself)."""
    import jax
    import jaxlib
    import numpy

    return [
        f"jax=={jax.__version__}",
        f"jaxlib=={jaxlib.__version__}",
        f"numpy=={numpy.__version__}",
    ]


class _Pyfunc:
    """`mlflow.pyfunc` as `Model.log`'s flavor, so that `Model.log(validate_serving_input=...)`
    can say whether MLflow checks that the logged model serves its input example: not for an
    export that does not run on this process's platform (`EvalSpec.export_platforms` without
    it), where the check can only fail (with a warning that the model is broken). MLflow hands
    the same keywords to the flavor's `save_model`, and pyfunc's refuses that one, so it stops
    here."""

    # As the module's: Model.log names a LoggedModel it makes after it (not here: it gets one).
    __name__ = "mlflow.pyfunc"

    @staticmethod
    def save_model(*args, validate_serving_input: bool = True, **kwargs):
        import mlflow.pyfunc

        return mlflow.pyfunc.save_model(*args, **kwargs)


_PYFUNC = _Pyfunc()


def warm_jax() -> None:
    """Import JAX and start its CPU client and XLA's compiler, as a process's first
    `log_export_model` would (see `warm_mlflow`)."""
    import jax
    import numpy as np

    jax.jit(lambda x: x + 1)(np.zeros(1, np.float32)).block_until_ready()


def warm_mlflow() -> None:
    """Import MLflow's model modules and build its map of installed packages (its check of a
    model's requirements walks every installed distribution's files), as a process's first
    `log_export_model` would. With `warm_jax`, most of that CPU is spent once per process."""
    import mlflow.pyfunc  # noqa: F401
    from mlflow.models import Model, infer_signature  # noqa: F401

    try:
        from mlflow.utils.requirements_utils import _init_packages_to_modules_map
    except ImportError:  # (a private name of MLflow's: the first model builds the map itself)
        return
    _init_packages_to_modules_map()


def log_export_model(
    client,
    tracking_uri: str,
    experiment_id: str,
    run_id: str,
    job: str,
    job_key: str,
    step: int,
    export_dir: str,
    example,
) -> Any:
    """Log the export in `export_dir` (local) as an MLflow Model of the run at `step`; returns its
    LoggedModel id."""
    import jax
    import mlflow
    from mlflow.models import Model

    model_file = os.path.join(export_dir, MODEL_FILE)
    with open(model_file, "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    example = typed_example(exported, example)
    runs_here = (
        jax.export.default_export_platform() in exported.platforms
    )  # the MLflow worker's: cpu (`mlflow_worker._worker_environment`)
    signature = export_signature(exported, example)
    info_path = os.path.join(export_dir, EXPORT_INFO_FILE)
    metadata = {}
    # the model's files: the export, and its record where whole (the pyfunc checks its inputs
    # against what the record says of them; not `model_config`, which MLflow logs as run params)
    artifacts = {"jax_export": model_file}
    if os.path.exists(info_path):
        try:
            with open(info_path) as f:
                info = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # the model itself is whole
            logger.warning(
                "the record %s is damaged (%s: %s): step %s's model is registered without its "
                "metadata (prefect-jax status lists the record)",
                info_path,
                type(exc).__name__,
                exc,
                step,
            )
            info = {}
        metadata = {
            k: info[k]
            for k in ("program", "program_fingerprint", "metrics", "eval_name")
            if k in info
        }
        if info.get("inputs"):  # (and in the metadata, for a reader of the model's page)
            artifacts["export_info"] = info_path
            metadata["inputs"] = info["inputs"]
    metadata["platforms"] = list(
        exported.platforms
    )  # where it loads: cpu, cuda, rocm, tpu by default
    mlflow.set_tracking_uri(tracking_uri)  # Model.log reads the global URI
    # The model's requirements are the ones above, not the uv project of the working directory
    # (the MLflow worker's environment says so already: `mlflow_worker._worker_environment`).
    os.environ.setdefault("MLFLOW_UV_AUTO_DETECT", "false")
    # Created here, in the run's experiment (Model.log alone would use the process's active
    # experiment), then filled by Model.log.
    create_key = uuid.uuid4().hex  # (a resent create's twin carries the same)
    name, tags = (
        logged_model_name(job, step),
        {JOB_TAG: job_key, STEP_TAG: str(step), CREATE_TAG: create_key},
    )
    made = client.create_logged_model(
        experiment_id, name=name, source_run_id=run_id, tags=tags, model_type="jax.export"
    )
    logged = one_logged_model(client, experiment_id, run_id, create_key, made)
    # MLflow loads the model to check the example: no __pycache__ of that into the model's files.
    writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        model_info = Model.log(
            artifact_path=None,
            name=name,
            flavor=_PYFUNC,
            # MLflow serves the example through the model to check it: where it runs
            validate_serving_input=runs_here,
            python_model=PYFUNC_FILE,
            artifacts=artifacts,
            signature=signature,
            input_example=example,
            pip_requirements=requirements(),
            metadata={"prefect_jax": {"job": job, "step": step, **metadata}},
            run_id=run_id,
            step=step,
            model_id=logged.model_id,
        )
    finally:
        sys.dont_write_bytecode = writes_bytecode
    return model_info.model_id


def sync_registry(
    client,
    tracking_uri: str,
    experiment_id: str,
    run_id: str,
    name: str,
    job: str,
    job_key: str,
    aliases: dict[str, int],
    local_export: Callable[[int], str],
    example,
    description: str = "",
    steps: list[int] = (),
    notes: dict[int, str] | None = None,
) -> dict[str, Any]:
    """Make sure every exported step (`steps`, and every step an alias points at) is a version of
    `name`, registered in step order, then point the aliases.

    Args:
        aliases: ``{alias: step}``.
        steps: the job's exported steps (a process killed before its MLflow thread registered
            one leaves it to the next sync).
        local_export: a local directory holding the export of a step (downloads a remote one).
        example: an input example (NumPy array) for the signature and the model page.
        notes: ``{step: its evaluation}``, after the job and step in a new version's description.

    Returns:
        ``{"name", "versions": {step: version}, "aliases": {alias: version}}``.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    # create_model_version resolves a models:/<id> source with the global URI, as Model.log
    # logs with it: a process that only registers (its model was logged before a kill) needs it too.
    mlflow.set_tracking_uri(tracking_uri)
    try:
        model = client.get_registered_model(name)
        if description and model.description != description:  # (an older one's, say)
            client.update_registered_model(name, description=description)
    except MlflowException:
        try:
            client.create_registered_model(name, description=description or None)
        except MlflowException:  # created meanwhile by another process
            pass
    versions = job_versions(client, name, job_key)
    for step in sorted(set(steps) | set(aliases.values())):
        if step in versions:
            continue
        logged = logged_model_of_step(client, experiment_id, run_id, step)
        if logged is not None:
            model_id = logged.model_id
        else:
            try:
                export_dir = local_export(step)
            except FileNotFoundError:  # (`export_retention.prune` held it: MLflow was far behind)
                logger.warning(
                    "step %d was exported, then pruned before it could be registered: skipped%s",
                    step,
                    " (its alias stays where it was)" if step in aliases.values() else "",
                )
                continue
            model_id = log_export_model(
                client, tracking_uri, experiment_id, run_id, job, job_key, step, export_dir, example
            )
        source = f"models:/{model_id}"
        made = client.create_model_version(
            name,
            source=source,
            run_id=run_id,
            model_id=model_id,
            tags={JOB_TAG: job_key, STEP_TAG: str(step)},
            description=f"job {job}, step {step}"
            + (f": {notes[step]}" if notes and step in notes else ""),
        )
        versions[step] = one_version(client, name, job_key, step, made)
        logger.info(
            "registered model %s version %s: job %s step %d",
            name,
            versions[step].version,
            job,
            step,
        )
    current = dict(client.get_registered_model(name).aliases or {})  # {alias: version}
    aliases = {alias: step for alias, step in aliases.items() if step in versions}
    for alias, step in aliases.items():
        version = versions[step].version
        if str(current.get(alias)) != str(version):
            client.set_registered_model_alias(name, alias, version)
    # The record holds every alias on one of the job's versions, not only those moved now (an
    # export of the latest exporter alone left out @best and @final).
    own = {str(v.version) for v in versions.values()}
    recorded = {alias: str(v) for alias, v in current.items() if str(v) in own}
    recorded.update({alias: str(versions[step].version) for alias, step in aliases.items()})
    return {
        "name": name,
        "versions": {step: str(v.version) for step, v in sorted(versions.items())},
        "aliases": recorded,
    }
