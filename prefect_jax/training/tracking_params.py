"""A job's params in its MLflow run: what they are (`job_params`), logged when the run is made,
brought up to date when a rerun reopens it.

MLflow keeps a param's first value for good (a second value is refused), so a rerun that changes
the job (trains further, evaluates otherwise) records each changed value as tag
``prefect_jax.param.<key>``. Called on the MLflow worker's side of a `Tracker` (`tracking_run`).
"""

from __future__ import annotations

import logging
from typing import Any

from prefect_jax.training.names import CHANGED_PARAM_TAG

logger = logging.getLogger("prefect_jax.tracking")

UNSET = "<unset>"  # the value now of a param this attempt does not have
MAX_TAG_KEY = 250  # MLflow's longest tag key: a changed param whose tag would be longer keeps none
BATCH = 100  # MLflow's most params in one log_batch


def log_params(client, run_id: str, params: dict[str, Any]) -> None:
    """Log `params` in the run, in batches MLflow takes."""
    from mlflow.entities import Param

    items = [Param(k, str(v)) for k, v in sorted(params.items())]
    for i in range(0, len(items), BATCH):
        client.log_batch(run_id, params=items[i : i + BATCH])


def reconcile_params(client, run, params: dict[str, Any]) -> None:
    """Bring a reopened `run`'s record of the job's params up to this attempt's `params`: a key
    the run lacks (a field added since) is logged as a param; one whose value changed (a rerun
    that trains further, or evaluates otherwise) cannot be, since MLflow refuses a param's second
    value, so its value now is tag ``prefect_jax.param.<key>`` (``<unset>`` for a key this
    attempt lacks: an exporter fewer), which a rerun that changes it back removes. Said once in
    the log, key by key."""
    from mlflow.entities import RunTag

    run_id, logged, tags = run.info.run_id, run.data.params, run.data.tags
    current = {k: str(v) for k, v in params.items()}
    new = {k: v for k, v in current.items() if k not in logged}
    log_params(client, run_id, new)
    changed = {
        k: current.get(k, UNSET)
        for k in logged
        if current.get(k, UNSET) != logged[k] and len(CHANGED_PARAM_TAG + k) <= MAX_TAG_KEY
    }
    now = [
        RunTag(CHANGED_PARAM_TAG + k, v)
        for k, v in sorted(changed.items())
        if tags.get(CHANGED_PARAM_TAG + k) != v
    ]
    if now:
        client.log_batch(run_id, tags=now)
    for tag in sorted(tags):
        if tag.startswith(CHANGED_PARAM_TAG) and tag[len(CHANGED_PARAM_TAG) :] not in changed:
            client.delete_tag(run_id, tag)
    if new or now:
        said = [f"{k}={v!r} (new)" for k, v in sorted(new.items())] + [
            f"{k}: {logged[k]!r} -> {v!r}" for k, v in sorted(changed.items())
        ]
        logger.info(
            "MLflow run %s: params since it was created: %s (a changed param keeps its first "
            "value; its value now is tag %s<key>)",
            run_id,
            "; ".join(said),
            CHANGED_PARAM_TAG,
        )


def job_params(config, program, program_params=None) -> dict[str, str]:
    """A job's MLflow params: its program, specs and program config, flattened, and each of the
    program's typed parameters (`ProgramParams`) as ``program.<field>``."""
    params = flatten_params(
        "",
        {
            "program": config.program,
            "job": config.job,
            "train": config.train.model_dump(mode="json"),
            "eval": config.eval.model_dump(mode="json"),
            "checkpoint": config.checkpoint.model_dump(mode="json"),
            "program_config": getattr(program, "config", None) or {},
        },
    )
    if program_params is not None:
        params.update(flatten_params("program", program_params.values))
    return params


def flatten_params(prefix: str, obj: Any) -> dict[str, str]:
    """Flatten nested dicts/lists into ``a.b.0.c`` keys with string values (MLflow params)."""
    out: dict[str, str] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten_params(f"{prefix}.{k}" if prefix else str(k), v))
    elif isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], (dict, list, tuple)):
        for i, v in enumerate(obj):
            out.update(flatten_params(f"{prefix}.{i}", v))
    else:
        out[prefix] = str(obj)[:6000]
    return out
