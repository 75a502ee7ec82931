"""What users need to deploy prefect-jax roles on work pools.

- ``kubernetes-gpu.json``: a base job template for a Kubernetes work pool of GPU nodes: the
  Kubernetes worker's default template plus ``gpu_count`` (``nvidia.com/gpu`` requests and
  limits), ``node_selector``, ``tolerations`` (the GPU taint by default) and
  ``termination_grace_period_seconds`` (time to checkpoint on SIGTERM), with
  ``JAX_PLATFORMS=cuda`` in the default env.
- ``vertex-ai-gpu.json`` / ``vertex-ai-tpu.json``: job variables for a Vertex AI work pool
  (prefect-gcp's ``vertex-ai`` worker): an L4 GPU, or a TPU v5e slice, on Spot capacity.
- Several JAX processes per flow run (`prefect_jax.training.cluster`):
  ``kubernetes-gpu-multiprocess.json`` (an indexed job of ``num_processes`` GPU pods, with
  ``kubernetes-headless-service.yaml`` for their DNS names) and
  ``vertex-ai-tpu-multiprocess.json`` (workerpool0 plus ``workers`` replicas in workerpool1).
  Every replica runs ``prefect-jax process``: process 0 the flow run, the others its children.
- `automations`: an automation that reruns crashed trainer runs.
- `job_resource_id`: the event resource id of a job (storage + job), for deployment triggers.

Set up the pools (see docs/deploying.md)::

    uv run prefect work-pool create gpu --type kubernetes \\
        --base-job-template prefect_jax/deployments/kubernetes-gpu.json
    uv run prefect work-pool create cpu --type process
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

KUBERNETES_GPU_TEMPLATE = "kubernetes-gpu.json"
VERTEX_GPU_JOB_VARIABLES = "vertex-ai-gpu.json"
VERTEX_TPU_JOB_VARIABLES = "vertex-ai-tpu.json"
KUBERNETES_GPU_MULTIPROCESS_TEMPLATE = "kubernetes-gpu-multiprocess.json"
VERTEX_TPU_MULTIPROCESS_TEMPLATE = "vertex-ai-tpu-multiprocess.json"


def job_resource_id(job: str, storage: str) -> str:
    """The ``prefect.resource.id`` of a job's events (``prefect-jax.checkpoint.committed`` ...).

    ``prefect-jax.job.<job>.<hash>``: the hash (12 hex digits of SHA-256) is of the job's
    normalized storage root with credentials redacted, and the job, so same-named jobs on two
    storages never trigger each other's deployments. Use it as the ``match`` of a trigger::

        uv run python -c "
        from prefect_jax.deployments import job_resource_id
        print(job_resource_id('digits', '/var/lib/prefect-jax'))"

    or read it from ``prefect-jax status --job <job> --storage <storage>``.

    Args:
        job: the job name.
        storage: its storage, as given to the flows (a local path, a URL, or
            ``jax-checkpoint-storage/<block>``, which is loaded from the Prefect server).
    """
    from prefect_jax.blocks import BLOCK_PREFIX
    from prefect_jax.training.storage import job_digest

    if storage.startswith(BLOCK_PREFIX):
        from prefect_jax.blocks import resolve_storage

        storage = resolve_storage(storage)[0]
    return f"prefect-jax.job.{job}.{job_digest(storage, job)[:12]}"


def load(name: str) -> dict[str, Any]:
    """One of the JSON files shipped in this package, by file name."""
    return json.loads(resources.files(__name__).joinpath(name).read_text())


def kubernetes_gpu_template() -> dict[str, Any]:
    """The base job template of a Kubernetes GPU work pool."""
    return load(KUBERNETES_GPU_TEMPLATE)


def kubernetes_gpu_multiprocess_template() -> dict[str, Any]:
    """The base job template of a Kubernetes work pool whose flow runs train in several
    processes."""
    return load(KUBERNETES_GPU_MULTIPROCESS_TEMPLATE)


def vertex_tpu_multiprocess_template() -> dict[str, Any]:
    """The base job template of a Vertex AI work pool whose flow runs train on several TPU hosts."""
    return load(VERTEX_TPU_MULTIPROCESS_TEMPLATE)


def vertex_job_variables(accelerator: str = "gpu") -> dict[str, Any]:
    """Vertex AI job variables for a ``"gpu"`` or ``"tpu"`` trainer."""
    names = {"gpu": VERTEX_GPU_JOB_VARIABLES, "tpu": VERTEX_TPU_JOB_VARIABLES}
    if accelerator not in names:
        raise ValueError(f"accelerator={accelerator!r}: use 'gpu' or 'tpu'")
    return load(names[accelerator])
