"""What a job's committed steps are, wherever its storage is.

Above both kinds of storage: Orbax's own steps on a local path or ``gs://``
(`prefect_jax.training.checkpoints`) and uploaded steps with a commit marker anywhere else
(`prefect_jax.training.remote`). The command, the flows and the tests ask here, so neither
kind needs to know of the other.

Example:
    ```python
    from prefect_jax.training.steps import job_committed_steps, job_step_is_backup, step_meta
    from prefect_jax.training.storage import JobStorage

    storage = JobStorage("s3://bucket/runs", "exp-1", {"key": "...", "secret": "..."})
    steps = job_committed_steps(storage)                 # [100, 200]
    print([s for s in steps if not job_step_is_backup(storage, s)])
    print(step_meta(storage, steps[-1]))                 # its metadata item: {"max_steps": ...}
    ```
"""

from __future__ import annotations

from prefect_jax.training.remote import RemoteSteps

__all__ = ["job_committed_steps", "job_step_is_backup", "step_meta"]


def job_committed_steps(storage) -> list[int]:
    """Committed checkpoint steps of a job (`JobStorage`), wherever its storage is."""
    if storage.orbax_native:
        from prefect_jax.training.checkpoint_dirs import committed_steps

        return committed_steps(storage.checkpoint_dir)
    return RemoteSteps(storage.remote_checkpoint_url, storage.storage_options).committed_steps()


def job_step_is_backup(storage, step: int) -> bool:
    """Whether a committed step of a job is a backup (`CheckpointSpec.backups`), from its metadata
    item alone (no restore, no download); False when that cannot be read (an evaluation says
    why)."""
    return bool((step_meta(storage, step) or {}).get("backup"))


def step_meta(storage, step: int) -> dict | None:
    """A committed step's metadata item (`JobStorage`, wherever it is), read without a restore or
    a download; None where it cannot be read (the restore will say why)."""
    try:
        if storage.orbax_native:
            from prefect_jax.training.checkpoint_dirs import read_meta_file

            return read_meta_file(storage.checkpoint_dir, step)
        return RemoteSteps(storage.remote_checkpoint_url, storage.storage_options).read_meta(step)
    except Exception:  # noqa: BLE001 - unreadable: not known to be anything
        return None
