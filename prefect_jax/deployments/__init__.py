"""What users need to deploy prefect-jax roles on work pools.

- ``kubernetes-gpu.json``: a base job template for a Kubernetes work pool of GPU nodes: the
  Kubernetes worker's default template plus ``gpu_count`` (``nvidia.com/gpu`` requests and
  limits), ``node_selector``, ``tolerations`` (the GPU taint by default) and
  ``termination_grace_period_seconds`` (time to checkpoint on SIGTERM), with
  ``JAX_PLATFORMS=cuda`` in the default env.
- ``vertex-ai-gpu.json`` / ``vertex-ai-tpu.json``: job variables for a Vertex AI work pool
  (prefect-gcp's ``vertex-ai`` worker): an L4 GPU, or a TPU v5e slice, on Spot capacity.
- `automations`: an automation that reruns crashed trainer runs.

Set up the pools (see the README's "Deploying" section)::

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


def load(name: str) -> dict[str, Any]:
    """One of the JSON files shipped in this package, by file name."""
    return json.loads(resources.files(__name__).joinpath(name).read_text())


def kubernetes_gpu_template() -> dict[str, Any]:
    """The base job template of a Kubernetes GPU work pool."""
    return load(KUBERNETES_GPU_TEMPLATE)


def vertex_job_variables(accelerator: str = "gpu") -> dict[str, Any]:
    """Vertex AI job variables for a ``"gpu"`` or ``"tpu"`` trainer."""
    names = {"gpu": VERTEX_GPU_JOB_VARIABLES, "tpu": VERTEX_TPU_JOB_VARIABLES}
    if accelerator not in names:
        raise ValueError(f"accelerator={accelerator!r}: use 'gpu' or 'tpu'")
    return load(names[accelerator])
