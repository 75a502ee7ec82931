"""Programs that declare a mesh and their shardings: FSDP and data x model meshes on 8 CPU devices,
their refusals, and a SIGKILLed sharded job resumed exactly on another mesh and device count.

The sharded runs happen in processes of their own (`sharding_job.py`): the CPU device count is
fixed before jax imports, and this process already has jax with one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from prefect_jax.training.sharding import ShardingError, build_mesh, fsdp

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(TESTS_DIR, "sharding_job.py")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, env.get("PYTHONPATH", "")])
    return {**env, **extra}


def _run(*args: str, timeout: float = 600, **env: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, SCRIPT, *args],
        capture_output=True,
        text=True,
        env=_env(**env),
        cwd=TESTS_DIR,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_the_fsdp_rule_splits_the_largest_divisible_dimension_of_large_arrays():
    mesh = AbstractMesh((8,), ("data",))
    state = {
        "embed": jax.ShapeDtypeStruct((256, 16), np.float32),
        "small": jax.ShapeDtypeStruct((16, 48), np.float32),  # under FSDP_MIN_SIZE: replicated
        "odd": jax.ShapeDtypeStruct((12, 4100), np.float32),  # no dimension divides by 8
        "wide": jax.ShapeDtypeStruct((24, 4096), np.float32),
        "step": jax.ShapeDtypeStruct((), np.int32),
    }
    specs = fsdp(state, mesh)
    assert specs == {
        "embed": PartitionSpec("data", None),
        "small": PartitionSpec(None, None),
        "odd": PartitionSpec(None, None),
        "wide": PartitionSpec(None, "data"),
        "step": PartitionSpec(),
    }
    # On top of tensor-parallel specs: another dimension than theirs.
    base = {k: None for k in state} | {"wide": PartitionSpec(None, "model")}
    assert fsdp(state, AbstractMesh((4, 2), ("data", "model")), base=base)["wide"] == (
        PartitionSpec("data", "model")
    )
    # An axis the mesh lacks (a mesh param's typo): named with the mesh's, not a KeyError.
    with pytest.raises(
        ShardingError,
        match=r"fsdp\(axis='data'\): the mesh \{'dat': 8\} has no such axis: use one of \['dat'\]",
    ):
        fsdp(state, AbstractMesh((8,), ("dat",)))


def test_a_mesh_whose_sizes_do_not_match_the_devices_is_refused():
    assert dict(build_mesh({"data": -1}).shape) == {"data": len(jax.devices())}
    with pytest.raises(ShardingError, match=r"mesh_axes=\{'data': 2\} multiply to 2, not the 1"):
        build_mesh({"data": 2})
    with pytest.raises(
        ShardingError, match=r"sizes must be ints \(not booleans\), each positive or one -1"
    ):
        build_mesh({"data": -1, "model": -1})
    # a JSON true is an int to Python: on one device it would have made a mesh of 1
    with pytest.raises(ShardingError, match=r"mesh_axes=\{'data': True\}: sizes must be ints"):
        build_mesh({"data": True})


def test_a_mesh_that_does_not_fit_the_devices_of_all_processes_is_refused_naming_them():
    """A sharded program on several JAX processes gets one mesh over every process's devices
    (tests/test_multiprocess_sharding.py trains one): a mesh that does not fit all of them is
    refused when the loop places it, before any compute, naming the processes."""
    import dataclasses

    from prefect_jax.examples.bytelm import PRESETS, ByteLMProgram
    from prefect_jax.training.sharding import placement

    program = ByteLMProgram(dataclasses.replace(PRESETS["tiny"], mesh={"data": 3}))
    devices = jax.devices() * 4  # (as two processes of two devices each list them)
    with pytest.raises(
        ShardingError,
        match=r"mesh_axes=\{'data': 3\} multiply to 3, not the 4 devices; .* \(the mesh spans the "
        r"devices of all 2 JAX processes: 2 in each\)",
    ):
        placement(program, devices, 2)


def test_bad_meshes_specs_and_batches_are_refused_before_any_compute_and_nnx_annotations_work():
    (result,) = _run("bad", "8")
    refused = result["refused"]
    assert "mesh_axes={'data': 3} multiply to 3, not the 8 devices; give sizes" in refused["mesh"]
    assert "the fixed sizes multiply to 3, which does not divide the 8" in refused["mesh_rest"]
    assert (
        "'params/head/kernel': P(None, 'model') names axis 'model', which the mesh {'data': 8} "
        "lacks: use one of ['data']" in refused["axis"]
    )
    assert (
        "splits dimension 0 of shape (12, 256) (12) into 8 parts over ('data',), which does not "
        "divide it: shard another dimension, or make it a multiple of 8"
    ) in refused["not_divisible"]
    assert (
        "a train batch leaf 'tokens' of shape (4, 33) cannot be split into 8 parts along "
        "dimension 0"
        in refused["batch"]
        and "make the batch size a multiple of 8" in refused["batch"]
    )
    assert all(r.startswith("ShardingError: ") for r in refused.values()), refused
    # A Flax NNX model built with nnx.with_partitioning, its init given no mesh: built and
    # trained sharded as its annotations say.
    assert result["annotated"]["kernel"] == "P(None, 'model')"
    assert np.isfinite(result["annotated"]["loss"])
    # A mesh axis that splits neither the state nor the batches: a warning naming it, as the
    # loop is made (the job runs: a model may use it in constraints the engine cannot see).
    assert result["idle"] == {
        "spare": [
            "mesh axis 'spare' of {'data': 4, 'spare': 2} splits neither the state nor the "
            "batches: its 2 devices each repeat the same work. Name it in the program's "
            "shardings (or batch_spec), or leave it out of mesh_axes"
        ],
        "used": [],
    }


def test_idle_axes_are_the_axes_of_several_devices_no_spec_names():
    from jax.sharding import NamedSharding

    from prefect_jax.training.sharded_state import idle_axes

    mesh = AbstractMesh((4, 2, 1), ("data", "model", "one"))
    batch = NamedSharding(mesh, PartitionSpec("data"))
    fsdp_only = {"w": PartitionSpec("data", None), "b": None}
    assert idle_axes(mesh, fsdp_only, batch) == ["model"]  # "one": a single device, idle or not
    tensor = {"w": PartitionSpec("data", "model"), "b": NamedSharding(mesh, PartitionSpec())}
    assert idle_axes(mesh, tensor, batch) == []
    both = NamedSharding(mesh, PartitionSpec(("data", "model")))  # the batch over both axes
    assert idle_axes(mesh, fsdp_only, both) == []
    replicated = NamedSharding(mesh, PartitionSpec())
    assert idle_axes(mesh, {"w": None, "b": replicated}, replicated) == ["data", "model"]


@pytest.mark.slow
def test_fsdp_8_way_and_4x2_data_model_shard_the_state_and_train_as_one_device_does():
    (out,) = _run("loss", "8")
    runs = out["runs"]
    one, fsdp8 = runs["one_device"], runs["fsdp8"]
    assert out["token_gathers"] == []  # accumulation's micro-batches stay on their devices
    assert fsdp8["specs"] == {
        "embed": "P('data', None)",
        "head": "P(None, 'data')",
        "qkv": "P(None, None)",  # under FSDP's minimum size: replicated
        "head_mu": "P(None, 'data')",  # Adam's moments follow their parameter
    }
    np.testing.assert_allclose(fsdp8["loss"], one["loss"], rtol=1e-4)
    np.testing.assert_allclose(fsdp8["eval"], one["eval"], rtol=1e-4)
    # Eval batches are split over the data axis as train batches are (left whole, each device
    # evaluated the whole batch: a data-parallel state's replicas did the same work 8 times).
    assert (one["eval_batches"], fsdp8["eval_batches"]) == (["host"] * 2, ["P('data',)"] * 2)
    # bfloat16 compute, gradient accumulation and 3 steps per dispatch, on a 4x2 mesh.
    mixed, base = runs["mixed_4x2"], runs["mixed_one_device"]
    assert mixed["specs"] == {
        "embed": "P('data', None)",
        "head": "P('data', 'model')",
        "qkv": "P(None, 'model')",
        "head_mu": "P('data', 'model')",
    }
    np.testing.assert_allclose(mixed["loss"], base["loss"], rtol=2e-3)
    # Sharded or not, one step per dispatch or a scan of three, the background compile and the
    # loop's calls share one trace of the program's train step.
    assert {name: run["traced"] for name, run in runs.items()} == dict.fromkeys(runs, 1)


@pytest.mark.slow
def test_a_sigkilled_fsdp_job_resumes_exactly_on_another_mesh_and_evaluates_on_six_devices(
    tmp_path, mlflow_uri
):
    from mlflow.tracking import MlflowClient
    from process_helpers import wait_until

    from prefect_jax.training.checkpoint_dirs import committed_steps
    from prefect_jax.training.names import DEVICES_TAG, STORAGE_TAG

    # The store's tables made first: a kill in the middle of their creation is MLflow's problem.
    MlflowClient(mlflow_uri).search_experiments()
    storage = str(tmp_path / "storage")
    ckpt = os.path.join(storage, "sharded", "checkpoints")
    log = open(tmp_path / "1.log", "w")
    # Paced (a sleep at each log point), so that the kill lands mid-job. Its saves copy the
    # sharded state on its devices and give the copy to Orbax on a thread (`save_handoff`), as on
    # a GPU: the step restored below is the state the killed process trained, bit for bit.
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "job", "8", storage, mlflow_uri, "40", "0.5"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=_env(SHARDING_JOB_MESH='{"data": -1}', SHARDING_JOB_DEVICE_COPY="1"),
        cwd=TESTS_DIR,
    )

    def committed_and_reported():  # the step's line (its fingerprint) is printed after its save
        steps = committed_steps(ckpt)
        return steps and f'"step": {steps[-1]},' in (tmp_path / "1.log").read_text()

    try:
        wait_until(committed_and_reported, 300, "a committed checkpoint", proc, poll=0.05)
    finally:
        proc.kill()
    proc.wait(timeout=60)
    log.close()
    lines = [json.loads(x) for x in open(tmp_path / "1.log") if x.startswith("{")]
    assert lines[0]["specs"]["embed"] == "P('data', None)"  # FSDP over 8 devices
    saved = {line["step"]: line["fp"] for line in lines if "step" in line}
    at = committed_steps(ckpt)[-1]
    assert at < 40 and at in saved, (at, saved)

    first, *rest = _run(
        "job", "4", storage, mlflow_uri, "40", "0", SHARDING_JOB_MESH='{"data": 2, "model": 2}'
    )
    assert first["start"] == at and first["fp"] == saved[at]  # restored bit for bit, resharded
    assert first["specs"] == {
        "embed": "P('data', None)",
        "head": "P('data', 'model')",
        "qkv": "P(None, 'model')",
        "head_mu": "P('data', 'model')",
    }
    assert rest[-1]["end"] == 40 and committed_steps(ckpt)[-1] == 40
    # The MLflow run says what its newest attempt trained on: the devices and the mesh.
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("prefect-jax").experiment_id],
        filter_string=f"tags.`{STORAGE_TAG}` = '{storage}'",
    )
    assert run.data.tags[DEVICES_TAG] == "4 x cpu (cpu), mesh data=2 model=2"
    # An evaluator on 6 devices, which cannot split the train batch of 8: it never takes one, so
    # it evaluates; a trainer there is refused before its restore.
    (evaluated,) = _run(
        "evaluate", "6", storage, mlflow_uri, "40", SHARDING_JOB_MESH='{"data": -1}'
    )
    assert evaluated["step"] == 40 and evaluated["status"] == "EVALUATED", evaluated
    assert np.isfinite(evaluated["metrics"]["loss"])
    assert "cannot be split into 6 parts" in evaluated["train_refused"], evaluated


def test_a_program_declaring_no_sharding_says_it_trains_on_one_of_the_devices():
    """One process of a program that declares no sharding trains on its first device, as a bare
    `jax.jit` does: a probe's user with 8 devices read "training on 8 x cpu" (and the MLflow tag)
    and trained on one. The description says "1 of 8" and a warning names the fix; a program
    that declares its mesh gets neither."""
    code = (
        "import json, logging\n"
        "logging.basicConfig(format='%(message)s')\n"
        "from prefect_jax.training.program import load_program\n"
        "from prefect_jax.training.sharded_state import describe_devices\n"
        "from prefect_jax.training.sharded_state import warn_of_idle_devices\n"
        "plain = warn_of_idle_devices(load_program('prefect_jax.examples.digits:tiny'))\n"
        "declared = warn_of_idle_devices(load_program('annotated_program:program'))\n"
        "print(json.dumps([describe_devices(), plain, declared]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
        cwd=TESTS_DIR,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == ["1 of 8 x cpu (cpu)", 7, 0]
    (warned,) = [line for line in out.stderr.splitlines() if "declares no mesh_axes" in line]
    assert warned == (
        "the program declares no mesh_axes or shardings: it trains on 1 of this process's 8 "
        "devices, 7 idle. Declare mesh_axes = {'data': -1} for data parallel over all "
        "of them (a batch size that 8 divides), see docs/program.md's Sharding"
    )


def _command(*args: str) -> subprocess.CompletedProcess:
    """``prefect-jax run`` of ``annotated_program:program`` on 8 CPU devices."""
    return subprocess.run(
        [sys.executable, "-m", "prefect_jax.cli", "run", "--program", "annotated_program:program"]
        + ["--max-steps", "4", "--no-progress", *args],
        capture_output=True,
        text=True,
        env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
        cwd=TESTS_DIR,
        timeout=300,
    )


@pytest.mark.slow
def test_the_command_refuses_an_annotation_or_a_metric_of_a_sharded_program_before_its_run(
    tmp_path, mlflow_uri
):
    """An NNX model's annotation naming an axis its mesh lacks fails in Flax, inside init: the
    command refuses it in one line naming the mesh's axes, before any flow run (no job folder).
    And the best exporter's metric is checked against what its eval_step returns, traced under
    its mesh (without the mesh, Flax refuses to build the model, and the check was skipped: the
    job failed at its first export)."""
    common = ["--storage", str(tmp_path), "--mlflow-tracking-uri", mlflow_uri, "--exporters"]
    axis = _command("--job", "axis", *common, "--program-param", "axis=modle")
    assert axis.returncode == 2, axis.stderr[-3000:]
    assert (
        axis.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "prefect-jax run: error: the program's init fails traced under its mesh "
            "{'data': 4, 'model': 2} (ValueError: "
        )
    )
    assert "must name axes of ['data', 'model']" in axis.stderr
    assert "Traceback" not in axis.stderr and not (tmp_path / "axis").exists()

    metric = _command("--job", "metric", *common, "best", "--best-metric", "accuracy")
    assert metric.returncode == 2, metric.stderr[-3000:]
    assert metric.stderr.strip().splitlines()[-1] == (
        "prefect-jax run: error: --best-metric (exporter 'best') 'accuracy' is not a metric the "
        "evaluation produces (its eval_step and derive_metrics): it produces ['loss']; set it to "
        "one of those"
    )
    assert not (tmp_path / "metric").exists()
