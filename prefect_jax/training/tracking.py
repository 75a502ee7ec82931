"""MLflow records of a job: one run per job, found again by tag when the job runs again.

Tracking failures become warnings and training goes on, except in strict mode
(``PREFECT_JAX_MLFLOW_STRICT=1``, set by the test suite), where they raise, as MLflow's
own Keras callback does in tests.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import warnings
from typing import Any, Iterable

logger = logging.getLogger("prefect_jax.tracking")

JOB_TAG = "prefect_jax.job"
STORAGE_TAG = "prefect_jax.storage"
DEFAULT_EXPERIMENT = "prefect-jax"


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else SQLite in the working directory (MLflow's own default)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"


def strict() -> bool:
    return os.environ.get("PREFECT_JAX_MLFLOW_STRICT", "").lower() in ("1", "true", "yes")


class TrackingWarning(UserWarning):
    """An MLflow call failed; training went on."""


def _guarded(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if self.client is None:
            return None
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - tracking must never stop training
            if strict():
                raise
            msg = f"MLflow {fn.__name__} failed against {self.tracking_uri}: {exc!r}; training goes on"
            warnings.warn(msg, TrackingWarning, stacklevel=2)
            logger.warning(msg)
            return None

    return wrapper


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


class Tracker:
    """The MLflow run of one job.

    Args:
        tracking_uri: MLflow tracking URI (``sqlite:///...``, ``http://...``).
        experiment: experiment name.
        job_key: identifies the job across reruns (tag ``prefect_jax.job``).
    """

    def __init__(self, tracking_uri: str | None, experiment: str, job_key: str):
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.experiment = experiment
        self.job_key = job_key
        self.run_id: str | None = None
        self.client = None
        try:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=self.tracking_uri)
        except Exception as exc:  # noqa: BLE001
            if strict():
                raise
            warnings.warn(f"MLflow unavailable at {self.tracking_uri}: {exc!r}", TrackingWarning, stacklevel=2)

    @_guarded
    def start(
        self, params: dict[str, Any], tags: dict[str, str] | None = None, run_id: str | None = None, reopen: bool = True
    ) -> str:
        """Find this job's run (by `run_id` or by job tag) or create it; mark it RUNNING if `reopen`.

        Params are logged only when the run is created, so a rerun never conflicts with them.
        """
        client = self.client
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(self.experiment, artifact_location=self._artifact_root())
        run = None
        if run_id:
            try:
                run = client.get_run(run_id)
            except Exception:  # noqa: BLE001 - deleted or another store: fall back to the tag
                run = None
        if run is None:
            escaped = self.job_key.replace("'", "\\'")
            found = client.search_runs(
                [exp_id], filter_string=f"tags.`{JOB_TAG}` = '{escaped}'", max_results=1, order_by=["attributes.start_time ASC"]
            )
            run = found[0] if found else None
        if run is None:
            run = client.create_run(exp_id, tags={JOB_TAG: self.job_key, **(tags or {})}, run_name=tags.get("mlflow.runName") if tags else None)
            from mlflow.entities import Param

            items = [Param(k, v) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):
                client.log_batch(run.info.run_id, params=items[i : i + 100])
        elif reopen and run.info.status != "RUNNING":
            client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        return self.run_id

    def _artifact_root(self) -> str | None:
        """For a SQLite store, artifacts go beside the database (not into ./mlruns of whatever the
        working directory was); other stores keep their server's default."""
        if self.tracking_uri.startswith("sqlite:///"):
            db = self.tracking_uri[len("sqlite:///") :]
            return "file://" + os.path.join(os.path.dirname(os.path.abspath(db)), "mlartifacts", self.experiment)
        return None

    @_guarded
    def log_metrics(self, rows: Iterable[tuple[str, float, int]]) -> None:
        """Log ``(key, value, step)`` rows in one batched call."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(s)) for k, v, s in rows]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    @_guarded
    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, local_dir, artifact_path)

    @_guarded
    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, v)

    @_guarded
    def finish(self, status: str = "FINISHED") -> None:
        if self.run_id:
            self.client.set_terminated(self.run_id, status=status)

    @_guarded
    def has_metric_at(self, key: str, step: int) -> bool:
        """Whether `key` was already logged at `step` (so a retried write is not logged twice)."""
        return any(m.step == step for m in self.client.get_metric_history(self.run_id, key))

    @_guarded
    def last_logged_step(self, exclude_prefix: str = "") -> int | None:
        """The highest step at which any metric (except those under `exclude_prefix`) was logged."""
        keys = [k for k in self.client.get_run(self.run_id).data.metrics if not (exclude_prefix and k.startswith(exclude_prefix))]
        steps = [m.step for k in keys for m in self.client.get_metric_history(self.run_id, k)]
        return max(steps) if steps else None

    @_guarded
    def metric_history(self, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in self.client.get_metric_history(self.run_id, key)]
