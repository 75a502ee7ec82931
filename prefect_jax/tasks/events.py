"""Prefect events about a job: their resource (the job, on its storage) and a best-effort emit."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger

from prefect_jax.training.names import (  # noqa: F401 - the event names, imported from here too
    CHECKPOINT_EVENT,
    EVAL_EVENT,
    EVENT_STEP_LABEL,
    EVENT_STORAGE_LABEL,
    EXPORT_EVENT,
)
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.specs import JobConfig
from prefect_jax.training.storage import JobStorage


def job_resource(config: JobConfig) -> dict[str, str]:
    """The Prefect event resource of a job: ``prefect-jax.job.<job>.<hash of storage + job>``
    (`prefect_jax.deployments.job_resource_id`), with the job as its name and its storage as a
    label."""
    from prefect_jax.deployments import job_resource_id

    return {
        "prefect.resource.id": job_resource_id(config.job, config.storage),
        "prefect.resource.name": config.job,
        EVENT_STORAGE_LABEL: redact_url(JobStorage(config.storage, config.job).root),
    }


def emit(event: str, config: JobConfig, payload: dict[str, Any]) -> None:
    """Emit a prefect-jax event about a job (best effort: an events outage never stops training)."""
    from prefect.events import emit_event

    try:
        # The step as a resource label too: the UI's event details show labels, the payload only
        # under Raw.
        step = {EVENT_STEP_LABEL: str(payload["step"])} if payload.get("step") is not None else {}
        emit_event(event=event, resource={**job_resource(config), **step}, payload=payload)
    except Exception as exc:  # noqa: BLE001
        get_run_logger().warning("could not emit %s: %r", event, exc)
