"""prefect.yaml, the GPU/TPU work-pool templates and job variables, checked by Prefect itself."""

import asyncio
import re
from pathlib import Path

import pytest
import yaml

from prefect_jax.deployments import kubernetes_gpu_template, vertex_job_variables

ROOT = Path(__file__).resolve().parents[1]


def _placeholders(obj) -> set[str]:
    found = set()
    if isinstance(obj, dict):
        for v in obj.values():
            found |= _placeholders(v)
    elif isinstance(obj, list):
        for v in obj:
            found |= _placeholders(v)
    elif isinstance(obj, str):
        found |= set(re.findall(r"{{\s*([a-z_]+)\s*}}", obj))
    return found


def test_kubernetes_gpu_template_declares_every_placeholder_and_requests_gpus():
    template = kubernetes_gpu_template()
    declared = set(template["variables"]["properties"])
    assert _placeholders(template["job_configuration"]) <= declared
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    assert template["variables"]["properties"]["env"]["default"]["JAX_PLATFORMS"] == "cuda"


def _deployments():
    return {
        d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    }


def test_prefect_yaml_deployments_load_and_their_parameters_validate():
    from prefect.events import DeploymentEventTrigger
    from prefect.flows import load_flow_from_entrypoint

    deployments = _deployments()
    assert set(deployments) == {
        "digits-nightly",
        "digits-trainer-cpu",
        "digits-trainer",
        "digits-evaluator",
        "digits-export",
        "bytelm-tiny",
    }
    flows = {}
    for name, d in deployments.items():
        flow = load_flow_from_entrypoint(str(ROOT / d["entrypoint"]))
        flow.validate_parameters(d["parameters"])  # raises on a bad parameter
        flows[name] = flow.name
    assert flows == {
        "digits-nightly": "train_and_evaluate",
        "digits-trainer-cpu": "train",
        "digits-trainer": "train",
        "digits-evaluator": "evaluate",
        "digits-export": "export",
        "bytelm-tiny": "train_and_evaluate",
    }
    assert deployments["bytelm-tiny"]["parameters"]["program_params"]["preset"] == "tiny"
    assert deployments["digits-nightly"]["schedules"][0]["cron"] == "0 2 * * *"
    trigger = DeploymentEventTrigger(**deployments["digits-evaluator"]["triggers"][0])
    assert trigger.expect == {"prefect-jax.checkpoint.committed"}
    assert deployments["digits-trainer"]["work_pool"]["name"] == "gpu"
    assert deployments["digits-evaluator"]["work_pool"]["name"] == "cpu"
    # Every role has a variant on the local process pool (the README's
    # setup); GPU pools are overrides.
    cpu_roles = {flows[n] for n, d in deployments.items() if d["work_pool"]["name"] == "cpu"}
    assert cpu_roles == {"train_and_evaluate", "train", "evaluate", "export"}


async def _pool_and_deployment(template, job_variables):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from prefect_jax.flows import train

    async with get_client() as client:
        pool_name = "gpu-test"
        try:
            await client.delete_work_pool(pool_name)
        except Exception:  # noqa: BLE001 - not there yet
            pass
        await client.create_work_pool(
            WorkPoolCreate(name=pool_name, type="kubernetes", base_job_template=template)
        )
        flow_id = await client.create_flow(train)
        return await client.create_deployment(
            flow_id=flow_id,
            name="trainer-test",
            work_pool_name=pool_name,
            job_variables=job_variables,
            entrypoint="prefect_jax/flows/__init__.py:train",
        )


@pytest.mark.usefixtures("prefect_server")
def test_the_server_accepts_the_gpu_pool_and_validates_trainer_job_variables():
    from prefect.exceptions import PrefectHTTPStatusError

    template = kubernetes_gpu_template()
    trainer_vars = _deployments()["digits-trainer"]["work_pool"]["job_variables"]
    assert asyncio.run(_pool_and_deployment(template, trainer_vars))
    with pytest.raises(PrefectHTTPStatusError, match="gpu_count"):
        asyncio.run(_pool_and_deployment(template, {"gpu_count": "many"}))


def test_vertex_job_variables_for_gpu_and_tpu():
    gpu, tpu = vertex_job_variables("gpu"), vertex_job_variables("tpu")
    assert gpu["accelerator_type"].startswith("NVIDIA_") and gpu["env"]["JAX_PLATFORMS"] == "cuda"
    assert tpu["accelerator_type"].startswith("TPU_") and tpu["env"]["JAX_PLATFORMS"] == "tpu"
    with pytest.raises(ValueError, match="use 'gpu' or 'tpu'"):
        vertex_job_variables("npu")


def test_gpu_template_is_the_kubernetes_workers_default_plus_gpu_variables():
    from prefect_kubernetes.worker import KubernetesWorker

    official = KubernetesWorker.get_default_base_job_template()["variables"]["properties"]
    ours = kubernetes_gpu_template()["variables"]["properties"]
    assert set(official) <= set(ours)
    assert set(ours) - set(official) == {
        "gpu_count",
        "node_selector",
        "tolerations",
        "termination_grace_period_seconds",
    }


def test_the_kubernetes_worker_renders_a_gpu_job_manifest():
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    trainer_vars = _deployments()["digits-trainer"]["work_pool"]["job_variables"]
    config = asyncio.run(
        KubernetesWorkerJobConfiguration.from_template_and_values(
            kubernetes_gpu_template(), trainer_vars
        )
    )
    pod = config.job_manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["image"] == trainer_vars["image"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["terminationGracePeriodSeconds"] == 30
    env = (
        config.env
        if isinstance(config.env, dict)
        else {e["name"]: e.get("value") for e in config.env}
    )
    assert env["JAX_PLATFORMS"] == "cuda"


@pytest.mark.parametrize("accelerator", ["gpu", "tpu"])
def test_vertex_job_variables_validate_and_render_with_the_vertex_workers_template(accelerator):
    from prefect.utilities.schema_tools import validate
    from prefect.utilities.templating import apply_values
    from prefect_gcp.workers.vertex import VertexAIWorker

    template = VertexAIWorker.get_default_base_job_template()
    values = vertex_job_variables(accelerator)
    validate(values, template["variables"], raise_on_error=True, ignore_required=False)
    # Render the job spec as the worker does (without building its GCP credentials, which would
    # look for Google's metadata server).
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    job = apply_values(template["job_configuration"], {**defaults, **values})
    machine = job["job_spec"]["worker_pool_specs"][0]["machine_spec"]
    assert machine == {
        k: values[k] for k in ("accelerator_count", "accelerator_type", "machine_type")
    }
    assert job["job_spec"]["scheduling"] == {"strategy": "SPOT"}
