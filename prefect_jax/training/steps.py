"""What a job's committed steps are, wherever its storage is.

Above both kinds of storage: Orbax's own steps on a local path or ``gs://``
(`prefect_jax.training.checkpoints`) and uploaded steps with a commit marker anywhere else
(`prefect_jax.training.remote`). The command, the flows and the tests ask here, so neither
kind needs to know of the other.

Example:
    ```python
    from prefect_jax.training.steps import job_committed_steps, job_step_is_backup
    from prefect_jax.training.storage import JobStorage

    storage = JobStorage("s3://bucket/runs", "exp-1", {"key": "...", "secret": "..."})
    steps = job_committed_steps(storage)                 # [100, 200]
    print([s for s in steps if not job_step_is_backup(storage, s)])
    ```
"""

from __future__ import annotations

from prefect_jax.training.remote import RemoteSteps

__all__ = ["job_committed_steps", "job_step_is_backup", "why_not_exportable"]


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
    return bool(_step_meta(storage, step).get("backup"))


def _step_meta(storage, step: int) -> dict:
    """A committed step's metadata item ({} where it cannot be read)."""
    try:
        if storage.orbax_native:
            from prefect_jax.training.checkpoint_dirs import read_meta_file

            return read_meta_file(storage.checkpoint_dir, step)
        return RemoteSteps(storage.remote_checkpoint_url, storage.storage_options).read_meta(step)
    except Exception:  # noqa: BLE001 - unreadable: not known to be a backup
        return {}


def why_not_exportable(storage, job: str, step: int, eval_name: str, evaluated: list[int]) -> str:
    """Why `step` of a job (`JobStorage`) has no evaluation to export (`evaluated`: the steps
    that have one), with the fix that applies: a step not committed, one kept only to resume
    from (a preemption's checkpoint, a backup: never evaluated), or one to evaluate first."""
    have = f"{eval_name!r} has {evaluated}"
    committed = job_committed_steps(storage)
    if step not in committed:
        return (
            f"step {step} of job {job!r} is not committed (not yet, or retention removed it; "
            f"committed: {committed or 'none'}): nothing to export; export an evaluated step "
            f"({have}), or wait for it (--wait-for-checkpoint; a flow's wait_for_checkpoint)"
        )
    meta = _step_meta(storage, step)
    if meta.get("backup") or meta.get("preemption"):
        kind = "a backup" if meta.get("backup") else "a preemption's checkpoint"
        return (
            f"step {step} of job {job!r} is {kind}, kept to resume from: never evaluated or "
            f"exported; export an evaluated step ({have})"
        )
    return f"step {step} of job {job!r} was not evaluated ({have}): evaluate it first"
