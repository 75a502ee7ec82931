"""Prefect blocks: where a job's checkpoints live, and where its MLflow records go.

Example:
    ```python
    from prefect_jax.blocks import CheckpointStorage, MlflowTracking

    CheckpointStorage(url="/mnt/checkpoints").save("nightly", overwrite=True)
    MlflowTracking(tracking_uri="http://mlflow:5000", experiment="digits").save("team", overwrite=True)

    storage = CheckpointStorage.load("nightly")
    print(storage.job_storage("digits").checkpoint_dir)
    ```
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from pydantic import Field, field_validator


class CheckpointStorage(Block):
    """Where checkpoints, eval records and exports of training jobs live.

    Attributes:
        url: storage root: a local absolute directory or a URL (``gs://bucket/prefix``).
        storage_options: extra fsspec options for the URL's filesystem.
    """

    _block_type_name = "JAX Checkpoint Storage"
    _block_type_slug = "jax-checkpoint-storage"
    _logo_url = "https://raw.githubusercontent.com/jax-ml/jax/main/images/jax_logo_250px.png"
    _description = "Storage root for prefect-jax checkpoints, eval records and exports."

    url: str = Field(description="Storage root: a local directory or a URL such as gs://bucket/prefix.")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="Extra fsspec storage options.")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        from prefect_jax.training.storage import normalize_root

        return normalize_root(v)

    def job_storage(self, job: str):
        """The `JobStorage` of one job under this root."""
        from prefect_jax.training.storage import JobStorage

        return JobStorage(self.url, job)


class MlflowTracking(Block):
    """Where MLflow records of training jobs go.

    Attributes:
        tracking_uri: MLflow tracking URI (``sqlite:///...``, ``http://host:5000``).
        experiment: MLflow experiment name.
    """

    _block_type_name = "MLflow Tracking"
    _block_type_slug = "prefect-jax-mlflow-tracking"
    _description = "MLflow tracking URI and experiment for prefect-jax jobs."

    tracking_uri: str = Field(description="MLflow tracking URI.")
    experiment: str = Field("prefect-jax", description="MLflow experiment name.")


__all__ = ["CheckpointStorage", "MlflowTracking"]
