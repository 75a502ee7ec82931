"""How several JAX processes of one job find each other, as each launcher starts them: the
cluster config read from a launcher's environment (``PREFECT_JAX_*``, Kubernetes indexed jobs,
Vertex AI's ``CLUSTER_SPEC``, TF's ``TF_CONFIG``, SLURM), the GPUs of one machine shared out
between ``--processes N``, a pod's ``prefect-jax process`` command, and the multi-process work
pool templates rendered by the workers' own code. No JAX process is started here; the training
itself is in test_multiprocess.
"""

import json
import os
import subprocess
import sys

import pytest

from prefect_jax.training.cluster_config import ClusterConfigError, from_env


def test_cluster_config_comes_from_the_launchers_environment():
    explicit = {
        "PREFECT_JAX_NUM_PROCESSES": "4",
        "PREFECT_JAX_PROCESS_ID": "3",
        "PREFECT_JAX_COORDINATOR_ADDRESS": "10.0.0.5",
    }
    c = from_env(explicit)
    assert (c.num_processes, c.process_id, c.coordinator_address) == (4, 3, "10.0.0.5:8476")
    k8s = {
        "PREFECT_JAX_NUM_PROCESSES": "2",
        "JOB_COMPLETION_INDEX": "1",
        "PREFECT_JAX_COORDINATOR_ADDRESS": "train-0.train:1234",
    }
    c = from_env(k8s)
    assert (c.process_id, c.coordinator_address, c.source) == (
        1,
        "train-0.train:1234",
        "Kubernetes indexed job",
    )
    vertex = {
        "CLUSTER_SPEC": json.dumps(
            {
                "cluster": {
                    "workerpool0": ["chief:2222"],
                    "workerpool1": ["w0:2222", "w1:2222"],
                    "workerpool2": ["reduction-server:2222"],
                },
                "task": {"type": "workerpool1", "index": 1},
            }
        )
    }
    c = from_env(vertex)  # a reduction server (workerpool2) is no JAX training process
    assert (c.num_processes, c.process_id, c.coordinator_address) == (3, 2, "chief:2222")
    tf = {
        "TF_CONFIG": json.dumps(
            {
                "cluster": {"chief": ["c:1"], "worker": ["w:1"], "evaluator": ["e:1"]},
                "task": {"type": "evaluator", "index": 0},
            }
        )
    }
    assert from_env(tf) is None  # TF's evaluator is no training process: it evaluates alone
    # JAX's own detection (srun tasks, Open MPI, TPU slices) is asked for; a run alone in a SLURM
    # allocation of several tasks stays one process.
    assert from_env(
        {"PREFECT_JAX_NUM_PROCESSES": "auto", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"}
    ).auto
    assert from_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"}) is None
    assert from_env({"PREFECT_JAX_NUM_PROCESSES": "1"}) is None and from_env({}) is None

    bad = [
        ({"PREFECT_JAX_NUM_PROCESSES": "two"}, "PREFECT_JAX_NUM_PROCESSES='two' is not an integer"),
        (
            {"PREFECT_JAX_NUM_PROCESSES": "2", "PREFECT_JAX_COORDINATOR_ADDRESS": "h:1"},
            "set PREFECT_JAX_PROCESS_ID",
        ),
        (
            {"PREFECT_JAX_NUM_PROCESSES": "2", "PREFECT_JAX_PROCESS_ID": "1"},
            "PREFECT_JAX_COORDINATOR_ADDRESS is not set",
        ),
        ({**explicit, "PREFECT_JAX_PROCESS_ID": "4"}, "PREFECT_JAX_PROCESS_ID=4 is outside 0..3"),
        ({**explicit, "PREFECT_JAX_COORDINATOR_ADDRESS": "h:port"}, "is not host:port"),
        ({"TF_CONFIG": "{"}, "TF_CONFIG is not a cluster spec"),
        # As TF's train_and_evaluate: `local` is not a cluster task, an unknown type is named.
        (
            {"TF_CONFIG": json.dumps({"cluster": {"worker": ["w:1"]}, "task": {"type": "local"}})},
            "task type 'local' is not a cluster task; for one process, leave 'cluster' and 'task'",
        ),
        (
            {"TF_CONFIG": json.dumps({"cluster": {"worker": ["w:1"]}, "task": {"type": "gpu"}})},
            r"task type 'gpu' is not supported; supported task types are \['chief', 'master'",
        ),
    ]
    for env, message in bad:
        with pytest.raises(ClusterConfigError, match=message):
            from_env(env)


def test_processes_on_one_machine_share_its_gpus_out_through_jaxs_local_device_ids(
    tmp_path, capsys
):
    """``--processes N`` on a machine with GPUs: each process its own (JAX would open every GPU in
    every process, each taking 75% of its memory); counted by nvidia-smi, or CUDA_VISIBLE_DEVICES.
    """
    from prefect_jax.cli.launch import process_envs

    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        + "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(8))
    )
    smi.chmod(0o755)
    base = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "HOME": str(tmp_path)}

    def shares(n, key="JAX_LOCAL_DEVICE_IDS", **env):
        return [
            e.get(key)
            for e in process_envs(n, "127.0.0.1:1", "http://api", False, dict(base, **env))
        ]

    envs = process_envs(2, "127.0.0.1:1234", "http://api", True, base)
    assert [
        (e["PREFECT_JAX_PROCESS_ID"], e["JAX_LOCAL_DEVICE_IDS"], e["PREFECT_JAX_EMBEDDED_API"])
        for e in envs
    ] == [("0", "0,1,2,3", "1"), ("1", "4,5,6,7", "1")]
    assert shares(8) == [str(i) for i in range(8)]
    assert capsys.readouterr().err == ""
    assert shares(3) == ["0,1", "2,3", "4,5"]  # 8 do not divide by 3: 2 each, 2 idle, and a warning
    assert "GPUs 6-7 idle" in capsys.readouterr().err
    # CUDA_VISIBLE_DEVICES: JAX numbers the visible GPUs from 0; CUDA
    # stops at an entry that is none.
    assert shares(2, CUDA_VISIBLE_DEVICES="3,5") == ["0", "1"]
    assert shares(2, CUDA_VISIBLE_DEVICES="GPU-8f3a,MIG-77c1") == ["0", "1"]
    assert shares(2, CUDA_VISIBLE_DEVICES="0,1,-1,2") == ["0", "1"]
    for nothing in ("", "NoDevFiles", "-1"):
        assert shares(2, CUDA_VISIBLE_DEVICES=nothing) == [None, None]
    # Fewer GPUs than processes: they share, without preallocating 75% of the memory each.
    assert shares(2, CUDA_VISIBLE_DEVICES="0") == [None, None]
    assert shares(2, "XLA_PYTHON_CLIENT_PREALLOCATE", CUDA_VISIBLE_DEVICES="0") == [
        "false",
        "false",
    ]
    assert "2 processes share 1 GPU(s)" in capsys.readouterr().err
    assert shares(2, JAX_PLATFORMS="cpu") == [None, None]  # CPU processes
    assert shares(2, JAX_PLATFORMS="cuda,cpu") == ["0,1,2,3", "4,5,6,7"]
    assert shares(2, JAX_LOCAL_DEVICE_IDS="0") == ["0", "0"]  # the caller's choice stands
    assert shares(2, PATH="/nonexistent") == [None, None]  # no nvidia-smi: no GPUs


def test_a_pods_process_command_finds_process_0_from_its_job_and_service():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_JAX_")}
    env.update(JOB_NAME="train-x7k2p", JOB_COMPLETION_INDEX="0")
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect_jax.cli",
            "process",
            "--processes=2",
            "--service=prefect-jax",
            "--",
            sys.executable,
            "-c",
            "import os; print(os.environ['PREFECT_JAX_COORDINATOR_ADDRESS'], "
            "os.environ['PREFECT_JAX_NUM_PROCESSES'])",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert shown == ["train-x7k2p-0.prefect-jax:8476", "2"]  # process 0 runs the command after --
    env.pop("JOB_NAME")
    refused = subprocess.run(
        [sys.executable, "-m", "prefect_jax.cli", "process", "--processes=2", "--", "echo", "hi"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert (
        refused.returncode == 2
        and "no coordinator address: set PREFECT_JAX_COORDINATOR_ADDRESS" in refused.stderr
    )
    # named as the subcommand, not as the worker's command (the positional's old dest)
    assert refused.stderr.splitlines()[-1].startswith("prefect-jax process: error: "), (
        refused.stderr
    )


def test_the_multiprocess_work_pool_templates_render_with_the_workers_own_code(prefect_server):
    import asyncio
    import uuid

    from prefect.client.schemas.objects import FlowRun
    from prefect.utilities.templating import apply_values
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    from prefect_jax.deployments import (
        kubernetes_gpu_multiprocess_template,
        vertex_tpu_multiprocess_template,
    )

    values = {
        "image": "us-docker.pkg.dev/p/prefect-jax/trainer:1",
        "num_processes": 4,
        "env": {"JAX_PLATFORMS": "cuda"},
    }
    config = asyncio.run(
        KubernetesWorkerJobConfiguration.from_template_and_values(
            kubernetes_gpu_multiprocess_template(), values
        )
    )
    config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="nightly"))
    spec = config.job_manifest["spec"]
    assert (
        spec["completionMode"],
        spec["completions"],
        spec["parallelism"],
        spec["backoffLimit"],
    ) == ("Indexed", 4, 4, 0)
    pod = spec["template"]["spec"]
    assert (
        pod["subdomain"] == "prefect-jax"
        and spec["template"]["metadata"]["labels"]["prefect-jax/cluster"] == "true"
    )
    container = pod["containers"][0]
    assert container["command"] + container["args"] == [
        "prefect-jax",
        "process",
        "--processes=4",
        "--service=prefect-jax",
        "--coordinator-port=8476",
        "--",
        "prefect",
        "flow-run",
        "execute",
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["JAX_PLATFORMS"]["value"] == "cuda" and "PREFECT__FLOW_RUN_ID" in env
    assert (
        env["JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.labels['batch.kubernetes.io/job-name']"
    )

    template = vertex_tpu_multiprocess_template()
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    job = apply_values(
        template["job_configuration"],
        {**defaults, "image": "img", "workers": 3, "prefect_api_url": "https://api"},
    )
    pools = job["job_spec"]["worker_pool_specs"]
    assert [p["replica_count"] for p in pools] == [1, 3]
    assert (
        pools[0]["container_spec"]["command"] == "prefect-jax process -- prefect flow-run execute"
    )
    assert {e["name"]: e["value"] for e in pools[1]["container_spec"]["env"]}[
        "PREFECT_API_URL"
    ] == "https://api"
    assert pools[1]["machine_spec"]["accelerator_type"] == "TPU_V5_LITEPOD"


def test_asking_whether_processes_joined_while_another_thread_imports_jax():
    """A sweep's trials on a threaded task runner: one trial's thread asked (`several`, and the
    restore's early lease) while another's was importing jax, and met its partial module
    ("partially initialized module 'jax' has no attribute 'process_count'"). A fresh interpreter
    asks in a loop for the whole of another thread's import."""
    code = (
        "import sys, threading\n"
        "from prefect_jax.training import cluster\n"
        "assert 'jax' not in sys.modules\n"
        "errors = []\n"
        "t = threading.Thread(target=lambda: __import__('jax'))\n"
        "t.start()\n"
        "while t.is_alive() and not errors:\n"
        "    try:\n"
        "        cluster.several()\n"
        "    except Exception as exc:\n"
        "        errors.append(repr(exc))\n"
        "t.join()\n"
        "print(errors)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout
