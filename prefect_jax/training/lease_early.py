"""A job's lease taken early: by a flow run's restore task before its trainer exists (so before
the process starts JAX), and adopted by the trainer made next (see `prefect_jax.training.lease`)."""

from __future__ import annotations

import contextlib
import os

from prefect_jax.training.lease import Lease
from prefect_jax.training.storage import JobStorage

# job dir: a lease taken before its trainer existed (`take_early`)
_taken_early: dict[str, Lease] = {}


def take_early(storage: JobStorage, owner_id: str | None, timeout_secs: float) -> Lease:
    """Take the job's lease before its trainer exists, so before this process starts JAX; the
    job's next `Job` adopts it (`adopt_early`). A flow run's restore task does this: a second
    process of the same flow run (Prefect started it twice) then finds this one holding the
    job and waits (`Lease.wait_for_duplicate`) before it starts JAX, rather than after, when its
    JAX start-up would already hold memory on a GPU that this process needs. Raises as `acquire`."""
    lease = Lease(storage, owner_id=owner_id, timeout_secs=timeout_secs)
    lease.acquire()
    _taken_early[storage.job_dir] = lease
    return lease


def adopt_early(job_dir: str, owner_id: str | None) -> Lease | None:
    """The lease `take_early` took of the job at `job_dir` for `owner_id` (its flow run), once;
    None if none was (or it was taken for another owner: that one stays for its own trainer)."""
    lease = _taken_early.get(job_dir)
    if lease is None or lease.owner_id != owner_id:
        return None
    return _taken_early.pop(job_dir)


def release_early(job_dir: str | None, lease: Lease | None = None) -> None:
    """Give back the lease `take_early` took of the job at `job_dir` (and `lease`, adopted or
    not): making the trainer failed (a program param refused, say). A local job folder left
    empty goes too: else `prefect-jax status` lists a job that never was (on object storage, no
    folder is left without a file)."""
    for taken in (_taken_early.pop(job_dir, None), lease):
        if taken is not None:
            taken.release()  # (once: a lease released already returns at once)
    if job_dir and "://" not in job_dir:
        with contextlib.suppress(OSError):  # (not empty: a job's, or another process's)
            os.rmdir(job_dir)
