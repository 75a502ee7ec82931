"""The flow run's progress artifact: the training's step against `max_steps`."""

# No `from __future__ import annotations`: see prefect_jax/flows/__init__.py.
import itertools
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from prefect_jax.training.names import TRAIN_PREFIX


def _progress(step: int, max_steps: int | None, job: str, metrics=None) -> dict[str, Any]:
    # No max_steps: the job trains until stopped; the bar stays empty, the step is in the text.
    if max_steps:
        description = f"training {job}: step {step} of {max_steps}"
        progress = 100.0 * min(step, max_steps) / max_steps
    else:
        description, progress = f"training {job}: step {step} (until stopped: no max_steps)", 0.0
    if metrics:
        description += " | " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
    return {"progress": progress, "description": description}


def shown_metrics(train: dict[str, float], evaluated: dict[str, float], name: str = "eval"):
    """The metrics the progress card shows: the last log point's train means (and throughput) as
    ``train/<name>``, and the last evaluation's metrics, derived ones included, as
    ``<eval name>/<name>``."""
    return {
        **{TRAIN_PREFIX + k: v for k, v in sorted(train.items())},
        **{f"{name}/{k}": v for k, v in sorted(evaluated.items())},
    }


def _progress_artifact(step: int, max_steps: int, job: str):
    """The flow run's progress artifact: a rerun of the same flow run (the UI's Retry) updates the
    one its earlier attempt made instead of adding a second; else a new one."""
    from prefect.runtime import flow_run

    if flow_run.id and flow_run.run_count > 1:
        try:
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.filters import (
                ArtifactFilter,
                ArtifactFilterFlowRunId,
                ArtifactFilterType,
            )

            with get_client(sync_client=True) as client:
                earlier = client.read_artifacts(
                    artifact_filter=ArtifactFilter(
                        flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]),
                        type=ArtifactFilterType(any_=["progress"]),
                    ),
                    limit=1,
                )
            if earlier:
                return update_progress_artifact(earlier[0].id, **_progress(step, max_steps, job))
        except Exception as exc:  # noqa: BLE001 - a second artifact is better than no training
            get_run_logger().warning("could not find this flow run's progress artifact: %r", exc)
    return create_progress_artifact(**_progress(step, max_steps, job))


def start_progress(shown: dict[str, Any], step: int, max_steps: int, job: str) -> None:
    """Make (or, in a rerun of the flow run, find) the progress artifact; its id into `shown`."""
    shown["id"] = _progress_artifact(step, max_steps, job)


_keys = itertools.count()


def progress_key() -> tuple[str, int]:
    """A key of its own for one loop's progress updates on the publisher (`_Publisher.refresh`)."""
    return ("progress", next(_keys))


def update_progress(
    shown: dict[str, Any], step: int, max_steps: int, job: str, metrics=None
) -> None:
    """Show `step` (and `metrics`, see `shown_metrics`) on the progress artifact
    `start_progress` made."""
    if shown.get("id") is not None:  # else its creation failed, and was logged
        update_progress_artifact(shown["id"], **_progress(step, max_steps, job, metrics))
