"""A job's lease in a test's folder, as a trainer of flow run "run-2" takes it."""

import os


def lease_under(tmp_path, timeout=60.0, storage_class=None):
    """A `Lease` of job "j" under `tmp_path`/storage (`storage_class`: a `JobStorage` that
    stands in for it), held by flow run "run-2"."""
    from prefect_jax.training.lease import Lease
    from prefect_jax.training.storage import JobStorage

    storage = (storage_class or JobStorage)(root=str(tmp_path / "storage"), job="j")
    os.makedirs(storage.job_dir, exist_ok=True)
    return Lease(storage, owner_id="run-2", timeout_secs=timeout)
