"""The engine: JAX, Orbax, Grain, fsspec and MLflow. Never imports prefect.

Names are loaded lazily, so importing the specs does not import jax.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TrainSpec": "specs",
    "EvalSpec": "specs",
    "CheckpointSpec": "specs",
    "JobConfig": "specs",
    "LatestExporter": "specs",
    "BestExporter": "specs",
    "FinalExporter": "specs",
    "EarlyStopping": "specs",
    "RetrySpec": "retry_spec",
    "TrainHook": "train_hooks",
    "TrainHookView": "train_hooks",
    "RemoteSteps": "remote",
    "AsyncUploader": "uploader",
    "redact_url": "redaction",
    "CorruptCheckpointError": "checksums",
    "NonFiniteLossError": "errors",
    "LeaseHeldError": "errors",
    "LeaseLostError": "errors",
    "NoProgressError": "errors",
    "EvalResult": "evaluation",
    "EvalStatus": "evaluation",
    "EvalRecords": "evaluation",
    "ProgramError": "program",
    "load_program": "program",
    "JobStorage": "storage",
    "Checkpoints": "checkpoints",
    "CheckpointMismatchError": "errors",
    "CheckpointSaveError": "errors",
    "JobDirectoryGoneError": "errors",
    "DamagedRecordError": "records",
    "state_fingerprint": "trees",
    "Trainer": "trainer",
    "restore_or_init": "session",
    "get_trainer": "live",
    "drop_trainer": "live",
    "live_trainer": "live",
    "add_progress_listener": "progress",
    "Job": "job",
    "Loop": "loop",
    "load_export": "exporters",
    "list_exports": "exporters",
    "is_the_final_export": "exporters",
    "Tracker": "tracking",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
