"""Prefect blocks: where a job's checkpoints live, and where its MLflow records go.

Example:
    ```python
    from prefect_jax.blocks import CheckpointStorage, MlflowTracking

    CheckpointStorage(url="/mnt/checkpoints").save("nightly", overwrite=True)
    tracking = MlflowTracking(tracking_uri="http://mlflow:5000", experiment="digits")
    tracking.save("team", overwrite=True)

    storage = CheckpointStorage.load("nightly")
    print(storage.job_storage("digits").checkpoint_dir)
    ```

Flows, deployments and the command take either block by name in place of a value:
``storage="jax-checkpoint-storage/nightly"``,
``mlflow_tracking_uri="prefect-jax-mlflow-tracking/team"``.
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator

from prefect_jax.training.names import DEFAULT_EXPERIMENT

BLOCK_PREFIX = "jax-checkpoint-storage/"
TRACKING_BLOCK_PREFIX = "prefect-jax-mlflow-tracking/"


class CheckpointStorage(Block):
    """Where checkpoints, eval records and exports of training jobs live.

    Flows and the CLI take ``storage="jax-checkpoint-storage/<block name>"`` in place of a URL.

    Attributes:
        url: storage root: a local absolute directory or a URL (``s3://bucket/prefix``,
            ``gs://bucket/prefix``, any fsspec URL).
        storage_options: extra fsspec options for the URL's filesystem (not secret: an
            endpoint URL, a region).
        secret_options: fsspec options that are secrets (``key`` and ``secret`` for s3fs,
            ``token`` for gcsfs...). They are given to the filesystem and nowhere else: not
            to logs, MLflow, artifacts or checkpoint metadata.
    """

    _block_type_name = "JAX Checkpoint Storage"
    _block_type_slug = "jax-checkpoint-storage"
    _logo_url = "https://raw.githubusercontent.com/jax-ml/jax/main/images/jax_logo_250px.png"
    _description = "Storage root for prefect-jax checkpoints, eval records and exports."

    url: str = Field(
        description="Storage root: a local directory or a URL such as gs://bucket/prefix."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="Extra fsspec storage options."
    )
    secret_options: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="fsspec options that are secrets (e.g. key and secret for s3://).",
    )

    def fsspec_options(self) -> dict[str, Any]:
        """The storage options with the secrets revealed, for the filesystem only."""
        return {
            **self.storage_options,
            **{k: v.get_secret_value() for k, v in self.secret_options.items()},
        }

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        from prefect_jax.training.storage import normalize_root

        return normalize_root(v)

    def job_storage(self, job: str):
        """The `JobStorage` of one job under this root."""
        from prefect_jax.training.storage import JobStorage

        return JobStorage(self.url, job, self.fsspec_options())


def resolve_storage(storage: str) -> tuple[str, dict[str, Any]]:
    """A storage URL as is, or ``jax-checkpoint-storage/<name>`` loaded from Prefect: (url, fsspec
    options).

    Raises:
        ValueError: the block does not exist (the message names it and how to create it).
    """
    if not storage.startswith(BLOCK_PREFIX):
        return storage, {}
    block = _load_named(CheckpointStorage, storage, "storage block", "url", "a URL")
    return block.url, block.fsspec_options()


def _load_named(block_type: type[Block], value: str, what: str, field: str, instead: str):
    """The block `value` names (its type's slug, a slash, its name), loaded from Prefect.

    Raises:
        ValueError: it does not exist; the message names it and how to create it.
    """
    name = value.split("/", 1)[1]
    try:
        return block_type.load(name)
    except ValueError as exc:
        raise ValueError(
            f"{what} {value!r} was not found on the Prefect server: create it with "
            f"{block_type.__name__}({field}=...).save({name!r}), or pass {instead} instead"
        ) from exc


class MlflowTracking(Block):
    """Where MLflow records of training jobs go.

    Flows and the CLI take ``mlflow_tracking_uri="prefect-jax-mlflow-tracking/<block name>"``
    in place of a URI (`resolve_tracking`).

    Attributes:
        tracking_uri: MLflow tracking URI (``sqlite:///...``, ``http://host:5000``).
        experiment: MLflow experiment name.
    """

    _block_type_name = "MLflow Tracking"
    _block_type_slug = "prefect-jax-mlflow-tracking"
    _description = "MLflow tracking URI and experiment for prefect-jax jobs."

    tracking_uri: str = Field(description="MLflow tracking URI.")
    experiment: str = Field(DEFAULT_EXPERIMENT, description="MLflow experiment name.")


def resolve_tracking(
    tracking_uri: str | None, experiment: str | None
) -> tuple[str | None, str | None]:
    """An MLflow tracking URI as is, or ``prefect-jax-mlflow-tracking/<name>`` loaded from
    Prefect: (tracking URI, experiment). The experiment is `experiment` where given (a job's own
    experiment wins, even one named as the default), else the block's; None where neither (the
    job's config then takes the default one).

    No URI (None, ""): ``MLFLOW_TRACKING_URI``'s block where that names one (a work pool's
    environment, say), as the URI that variable gives is the job's default; else None (the
    tracker then reads the variable itself, or takes MLflow's default store).

    Raises:
        ValueError: the block does not exist (the message names it and how to create it).
    """
    if not tracking_uri:
        from prefect_jax.training.mlflow_client import default_tracking_uri

        default = default_tracking_uri()
        tracking_uri = default if default.startswith(TRACKING_BLOCK_PREFIX) else tracking_uri
    if not tracking_uri or not tracking_uri.startswith(TRACKING_BLOCK_PREFIX):
        return tracking_uri, experiment
    block = _load_named(
        MlflowTracking, tracking_uri, "MLflow tracking block", "tracking_uri", "a tracking URI"
    )
    return block.tracking_uri, experiment or block.experiment


def names_a_block(value: str | None) -> bool:
    """Whether `value` (a storage or a tracking URI) names a block, read from the Prefect API."""
    return bool(value) and value.startswith((BLOCK_PREFIX, TRACKING_BLOCK_PREFIX))


__all__ = [
    "CheckpointStorage",
    "MlflowTracking",
    "names_a_block",
    "resolve_storage",
    "resolve_tracking",
]
