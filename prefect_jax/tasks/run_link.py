"""The link artifact from a flow run to its job's MLflow run (key ``<job>-<8 hex>-mlflow-run``,
one per flow run) and the flow run's tags; `prefect_jax.tasks.runs.link_runs` decides when they
go out."""

from __future__ import annotations

import threading

from prefect import get_run_logger
from prefect.runtime import task_run

from prefect_jax.tasks.publish import (
    create_or_update_artifact,
    existing_artifact,
    job_artifact_key,
    publisher,
)
from prefect_jax.training.names import MLFLOW_RUN_TAG
from prefect_jax.training.specs import JobConfig
from prefect_jax.training.trainer_thread import wait_in_slices

_PENDING_TEXT = "not started yet"  # in the link's text until MLflow has answered


def publish_link(
    config: JobConfig,
    tracker,
    flow_run_id,
    mlflow_url: str | None,
    run_id: str | None,
    wait_secs: float = 0.0,
) -> None:
    """Tag the flow run ``mlflow-run:<run_id>`` and make (or update) its link artifact, on the
    publisher's thread; waits up to `wait_secs` for both (in slices, on a flow run's main thread:
    a signal's handler raises here). Without `mlflow_url`, the artifact says that MLflow has not
    answered yet (one made already is left alone)."""
    done = threading.Event()

    def publish() -> None:
        try:
            if flow_run_id and run_id:
                tag_flow_run(str(flow_run_id), [f"{MLFLOW_RUN_TAG}{run_id}"])
            _link_artifact(config, tracker, flow_run_id, mlflow_url)
        finally:
            done.set()

    publisher.submit(publish)
    if wait_secs > 0 and not wait_in_slices(done.wait, wait_secs):  # (for the run's signals)
        get_run_logger().warning(
            "the link to job %s's MLflow run is not in Prefect after %gs: it follows when Prefect "
            "answers",
            config.job,
            wait_secs,
        )


def _link_artifact(config: JobConfig, tracker, flow_run_id, mlflow_url: str | None) -> None:
    key = job_artifact_key(config.job, config.storage, "mlflow-run")
    existing = existing_artifact(key, flow_run_id) if flow_run_id else None
    if existing is not None and (mlflow_url is None or mlflow_url in (existing.data or "")):
        return  # one link per flow run: a real one replaces the "not yet" or the run-id-only one
    from prefect.artifacts import LinkArtifact

    from prefect_jax.training.redaction import redact_url

    where = redact_url(tracker.tracking_uri)
    if mlflow_url is None:
        artifact = LinkArtifact(
            link=tracker.home_url(),
            link_text=f"MLflow run of {config.job}: {_PENDING_TEXT}",
            key=key,
            description=f"MLflow at {where} had not started job {config.job}'s run when this "
            "flow run began training: the job's next run links it (this one does if the run "
            "starts meanwhile); the job's records are in its storage",
        )
    else:
        artifact = LinkArtifact(
            link=mlflow_url,
            link_text=f"MLflow run of {config.job}",
            key=key,
            description=f"The MLflow run of job {config.job}: params, train and eval curves, "
            f"exports ({where})",
        )
    if flow_run_id is None:  # outside any flow run: nothing to be one of
        artifact.create(_sync=True)
        return
    create_or_update_artifact(artifact, flow_run_id, task_run.id, existing=existing)


def tag_flow_run(flow_run_id: str, tags: list[str]) -> None:
    """Add `tags` to flow run `flow_run_id`'s tags (the ones it has stay)."""
    from uuid import UUID

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        current = client.read_flow_run(UUID(flow_run_id)).tags or []
        client.update_flow_run(UUID(flow_run_id), tags=sorted(set(current) | set(tags)))
