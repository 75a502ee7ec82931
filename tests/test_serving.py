"""Serving inputs as a real model needs them (issue 52): symbolic dimensions end to end (export,
MLflow signature, pyfunc), several named inputs, a broken serve() refused before training, and
exports lowered for the job's platform and cpu unless the user names others."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import train_to_end

from prefect_jax.training.exporters import load_export, serialize_serving
from prefect_jax.training.registry import PYFUNC_FILE
from prefect_jax.training.registry_signature import export_signature
from prefect_jax.training.specs import LatestExporter
from prefect_jax.training.trainer import Trainer


def _tensor_specs(schema) -> list[tuple[str | None, list[int]]]:
    return [(s.get("name"), list(s["tensor-spec"]["shape"])) for s in schema.to_dict()]


def test_named_inputs_are_exported_registered_and_served_as_a_dict(job_config, mlflow_uri):
    import mlflow

    config = job_config(
        max_steps=20, job="named", exporters=[LatestExporter()], program="programs:named_inputs"
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    train_to_end(trainer)
    path = trainer.job.storage.export_dir("latest", 20)
    info = json.load(open(os.path.join(path, "export.json")))
    assert info["inputs"] == [
        {"name": "pixels", "shape": ["b", 64], "dtype": "float32"},
        {"name": "temperature", "shape": ["b"], "dtype": "float32"},
    ]
    inputs = trainer.program.serving_example()
    expected = np.asarray(trainer.program.serve(trainer.state, inputs))
    np.testing.assert_allclose(np.asarray(load_export(path)(inputs)), expected, rtol=1e-6)
    name = trainer.exports.registered_model  # the job's own: `<job>-<hash of its storage>`
    trainer.finish()
    trainer.close()

    mlflow.set_tracking_uri(mlflow_uri)
    model_info = mlflow.models.get_model_info(f"models:/{name}@newest")
    assert _tensor_specs(model_info.signature.inputs) == [
        ("pixels", [-1, 64]),
        ("temperature", [-1]),
    ]
    assert _tensor_specs(model_info.signature.outputs) == [(None, [-1, 10])]
    model = mlflow.pyfunc.load_model(f"models:/{name}@newest")
    served = model.predict({k: v[:3] for k, v in inputs.items()})
    np.testing.assert_allclose(served, expected[:3], rtol=1e-6)
    with pytest.raises(Exception, match="temperature"):
        model.predict({"pixels": inputs["pixels"]})


def test_the_registered_lm_refuses_ids_outside_its_vocabulary_and_names_its_context(
    job_config, mlflow_uri
):
    """The export records what its program declared of its input (the sequence's constraint,
    which a serialized export loses; the ids' range), the registry hands it to the pyfunc as
    the model's config, and the model loaded from the registry refuses what breaks it: an id
    past the vocabulary would be answered with NaN logits, a sequence past the context with
    JAX's "Error refining shapes"."""
    import mlflow

    config = job_config(
        max_steps=4,
        every_steps=4,
        job="lm",
        exporters=[LatestExporter()],
        program="prefect_jax.examples.bytelm:tiny",
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    train_to_end(trainer)
    info = json.load(open(os.path.join(trainer.job.storage.export_dir("latest", 4), "export.json")))
    assert info["inputs"] == [
        {
            "name": None,
            "shape": ["b", "seq"],
            "dtype": "int32",
            "constraints": ["seq <= 32"],
            "values": [0, 256],
        }
    ]
    name, run_id = trainer.exports.registered_model, trainer.job.tracker.run_id
    trainer.finish()
    trainer.close()

    mlflow.set_tracking_uri(mlflow_uri)
    # (the record is one of the model's files, not its model_config: MLflow logs that as params
    # of the job's run, which a rerun would then report as changed)
    assert "inputs" not in mlflow.MlflowClient().get_run(run_id).data.params
    model = mlflow.pyfunc.load_model(f"models:/{name}@newest")
    assert np.isfinite(model.predict(np.full((1, 8), 255, np.int32))).all()
    with pytest.raises(ValueError, match=r"takes values 0 <= x < 256; .*from 7 to 300"):
        model.predict(np.array([[7, 300, 9]], np.int32))
    with pytest.raises(ValueError, match=re.escape("takes int32[b,seq] where seq <= 32")):
        model.predict(np.zeros((1, 40), np.int32))
    version = mlflow.MlflowClient().get_model_version_by_alias(name, "newest")
    assert (
        mlflow.models.get_model_info(f"models:/{name}@newest").metadata["prefect_jax"]["inputs"]
        == info["inputs"]
    ), version  # (what the model takes, on its page)

    # Served over HTTP (`mlflow models serve`): the refusal's own words reach the caller, not
    # MLflow's "unexpected error" (its scoring server passes on an MlflowException's message).
    from loopback_server import LoopbackServer

    model_uri = f"models:/{name}@newest"

    class Served(LoopbackServer):
        name = "mlflow models serve"

        def command(self):
            serve = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri]
            return [*serve, "--env-manager", "local", "-h", "127.0.0.1", "-p", str(self.port)]

        def process_env(self):
            bin_dir = os.path.dirname(sys.executable)  # (it starts uvicorn from PATH)
            path = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
            return dict(os.environ, PATH=path, MLFLOW_TRACKING_URI=mlflow_uri)

    served = Served(startup_timeout=120).start()
    try:
        answers = [_post(served, {"inputs": tokens}) for tokens in ([[7, 9]], [[7, 300]])]
    finally:
        served.stop()
    assert answers[0][0] == 200 and np.asarray(answers[0][1]["predictions"]).shape == (1, 2, 256)
    assert answers[1][0] == 400, answers[1]
    assert (
        "the input takes values 0 <= x < 256; given values from 7 to 300"
        in (answers[1][1]["message"])
    ), answers[1]


def _post(server, body: dict) -> tuple[int, dict]:
    """POST `body` as JSON to the server's /invocations: (status, the JSON answer)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"{server.endpoint_url}/invocations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


class _TokensAndScale:
    """Named inputs, one of them ids (int32) and one not: `serve` looks the ids up."""

    def serving_input(self):
        b, s = jax.export.symbolic_shape("b, s", constraints=("s <= 6",))
        return {
            "tokens": jax.ShapeDtypeStruct((b, s), np.int32),
            "scale": jax.ShapeDtypeStruct((b,), np.float32),
        }

    def serving_input_range(self):
        return {"tokens": (np.int64(1), np.int64(10))}  # (a NumPy vocabulary size, say)

    def serve(self, state, inputs):
        return jax.numpy.asarray(state["table"])[inputs["tokens"]].sum(-1) * inputs["scale"]


def test_named_inputs_record_their_own_constraints_and_ranges_and_the_model_checks_each(
    tmp_path,
):
    """Each input's record names the constraints of its own dims only (the scope's are shared),
    and a range only where the program gave one; the model checks each input by name, before
    the cast to its dtype (an int64 300 would be 44 as uint8, 300 - 2**32... as int32)."""
    from types import SimpleNamespace

    from prefect_jax.training.pyfunc_model import JaxExportModel
    from prefect_jax.training.serving import serving_example, serving_record

    program = _TokensAndScale()
    recorded = serving_record(program)
    assert recorded == [
        {
            "name": "tokens",
            "shape": ["b", "s"],
            "dtype": "int32",
            "constraints": ["s <= 6"],
            "values": [1, 10],
        },
        {"name": "scale", "shape": ["b"], "dtype": "float32"},
    ]
    state = {"table": np.arange(10, dtype=np.float32)}
    (tmp_path / "model.jax_export").write_bytes(serialize_serving(program, state, ["cpu"]))
    (tmp_path / "export.json").write_text(json.dumps({"inputs": recorded}))
    model = JaxExportModel()
    model.load_context(
        SimpleNamespace(
            artifacts={
                "jax_export": str(tmp_path / "model.jax_export"),
                "export_info": str(tmp_path / "export.json"),
            }
        )
    )
    ok = {"tokens": np.array([[1, 2, 9]]), "scale": np.array([2.0])}  # (int64, float64: cast)
    np.testing.assert_allclose(model.predict(None, ok), [24.0])
    with pytest.raises(
        ValueError, match=r"^input 'tokens' takes values 1 <= x < 10; given values from 1 to 12"
    ):
        model.predict(None, {**ok, "tokens": np.array([[1, 12, 9]])})
    with pytest.raises(
        ValueError, match=r"takes values 1 <= x < 10; given values from 1 to 4294967298"
    ):
        model.predict(None, {**ok, "tokens": np.array([[1, 2**32 + 2, 9]])})
    with pytest.raises(ValueError, match=re.escape("where s <= 6 (named")):
        model.predict(None, {**ok, "tokens": np.ones((1, 7), np.int32)})
    # an example within the range: ids from the eval data only where they fit, else the low
    assert (serving_example(program)["tokens"] == 1).all()


def test_a_serving_input_range_that_is_not_one_is_refused_before_training(job_config):
    """Named, with the fix: a float input's range, a name serving_input() does not have, no
    pair, an empty range; None is no range."""
    from prefect_jax.training.serving import check_serving, serving_ranges

    program = _TokensAndScale()
    state = {"table": jax.ShapeDtypeStruct((10,), np.float32)}
    program.serving_input_range = lambda: None
    assert serving_ranges(program, program.serving_input()) == {}
    for declared in (
        {"scale": (0, 16)},
        {"pixels": (0, 16)},
        (0, 16),
        {"tokens": (3, 3)},
        {"tokens": (0.0, 10)},
        {"tokens": (True, 10)},
    ):
        program.serving_input_range = lambda declared=declared: declared
        with pytest.raises(ValueError, match=r"serving_input_range\(\) returned .*: return \(low"):
            check_serving(program, "p", state)


def test_an_int_on_a_symbolic_dimension_is_refused_before_training(job_config):
    config = job_config(exporters=[LatestExporter()], program="programs:int_on_symbolic_dim")
    with pytest.raises(
        ValueError,
        match=r"program 'programs:int_on_symbolic_dim': serve\(state, inputs\) does not trace on "
        r"serving_input\(\) .*'shape': \['b', 64\].*Fix serve \(a symbolic dimension has no int",
    ):
        Trainer(config)
    checkpoints = os.path.join(config.storage, config.job, "checkpoints")
    assert not os.path.exists(checkpoints) or os.listdir(checkpoints) == []  # not a step trained


def test_the_command_checks_a_new_jobs_serve_unless_a_live_trainer_holds_the_job(tmp_path, request):
    """Its preflight refuses a serve that does not trace; beside a live trainer of the job (its
    lease held) it leaves JAX unstarted for a command the lease refuses: no check, no head
    start, also where only a head start would follow (no exporters, as for a rerun)."""
    from prefect_jax.training import head_start
    from prefect_jax.training.facade import preflight
    from prefect_jax.training.lease import Lease
    from prefect_jax.training.specs import EvalSpec, TrainSpec
    from prefect_jax.training.storage import JobStorage

    def check(exports: bool = True):
        preflight(
            "programs:int_on_symbolic_dim",
            "j",
            str(tmp_path),
            10,
            eval_spec=EvalSpec(exporters=[LatestExporter()] if exports else []),
            train_spec=TrainSpec(max_steps=10),
        )

    with pytest.raises(ValueError, match="serve\\(state, inputs\\) does not trace"):
        check()
    holder = subprocess.Popen(  # a live trainer of the job: another process, its lease held
        [sys.executable, "-c", HOLD_THE_LEASE, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not Lease(JobStorage(str(tmp_path), "j")).is_free()
        head_start._begun = None
        request.addfinalizer(lambda: setattr(head_start, "_begun", None))
        check()
        assert head_start._begun is None
        check(exports=False)
        assert head_start._begun is None
    finally:
        holder.kill()
        holder.wait()


HOLD_THE_LEASE = """
import sys, time
from prefect_jax.training.lease import Lease
from prefect_jax.training.storage import JobStorage
Lease(JobStorage(sys.argv[1], "j"), owner_id="live-trainer", timeout_secs=120).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_the_early_serve_check_traces_a_program_that_declares_a_mesh_as_its_loop_does():
    """The command's check of a new job's serve, with no abstract state from the sharding check
    (``--max-steps none``): init is given the mesh, as the loop gives it."""
    from prefect_jax.examples.digits import DigitsProgram
    from prefect_jax.training.serving import check_serving_early

    class MeshInit(DigitsProgram):
        mesh_axes = {"data": -1}

        def init(self, rng, mesh):
            assert dict(mesh.shape) == {"data": 1}
            return super().init(rng)

    program = MeshInit(hidden=(8, 8), learning_rate=1e-3, batch_size=8, dropout=0.0)
    assert check_serving_early(program, "mesh-init", None, seed=0) == ()
    assert check_serving_early(program, "mesh-init", ["cpu"], seed=0) == ("cpu",)


def test_the_lm_serves_any_sequence_length_up_to_its_context(tmp_path):
    import mlflow

    from prefect_jax.examples.bytelm import PRESETS, ByteLMProgram

    program = ByteLMProgram(PRESETS["tiny"])
    context = program.cfg.seq_len
    state = program.init(jax.random.key(0))
    model_bytes = serialize_serving(program, state, ["cpu"])
    exported = jax.export.deserialize(bytearray(model_bytes))
    for shape in [(2, 7), (1, context)]:
        tokens = np.arange(np.prod(shape), dtype=np.int32).reshape(shape) % 256
        np.testing.assert_allclose(
            np.asarray(exported.call(tokens)),
            np.asarray(program.serve(state, tokens)),
            rtol=1e-5,
            atol=1e-5,
        )
    with pytest.raises(Exception, match="shape"):  # past the context it was trained on
        exported.call(np.zeros((1, context + 1), np.int32))

    signature = export_signature(exported)
    assert _tensor_specs(signature.inputs) == [(None, [-1, -1])]
    assert _tensor_specs(signature.outputs) == [(None, [-1, -1, 256])]
    (tmp_path / "export").mkdir()
    model_file = tmp_path / "export" / "model.jax_export"
    model_file.write_bytes(model_bytes)
    mlflow.pyfunc.save_model(
        str(tmp_path / "model"),
        python_model=PYFUNC_FILE,
        artifacts={"jax_export": str(model_file)},
        signature=signature,
        input_example=program.serving_example(),
        pip_requirements=[],
    )
    tokens = np.frombuffer(b"import os\n", np.uint8).astype(np.int32)[None]
    logits = mlflow.pyfunc.load_model(str(tmp_path / "model")).predict(tokens)
    assert logits.shape == (1, tokens.shape[1], 256)
    np.testing.assert_allclose(
        logits, np.asarray(program.serve(state, tokens)), rtol=1e-5, atol=1e-5
    )


def test_exports_lower_for_the_job_platform_and_cpu_unless_named():
    from prefect_jax.examples.digits import tiny

    state = jax.jit(tiny.init)(jax.random.key(0))
    here = jax.export.default_export_platform()

    def platforms(named):
        return jax.export.deserialize(bytearray(serialize_serving(tiny, state, named))).platforms

    assert platforms(None) == tuple(dict.fromkeys((here, "cpu")))
    assert platforms(["all"]) == tuple(dict.fromkeys(("cpu", "cuda", "rocm", "tpu", here)))
    assert platforms(["tpu"]) == ("tpu",)


def test_a_serve_building_an_annotated_model_without_a_mesh_is_told_to_build_it_outside_one():
    """Flax builds an NNX model with sharding annotations only under a mesh, unless its eager
    sharding is off; serve is traced for one device, with none: the refusal says so, not the
    symbolic-dimension fix."""
    import jax.numpy as jnp
    from flax import nnx

    from prefect_jax.training.serving import check_serving

    class Annotated:
        def serving_input(self):
            return jax.ShapeDtypeStruct((2, 8), jnp.float32)

        def serve(self, state, x):
            kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            return nnx.Linear(8, 4, kernel_init=kernel, rngs=nnx.Rngs(0))(x)

    state = {"w": jax.ShapeDtypeStruct((1,), jnp.float32)}
    with pytest.raises(ValueError) as refused:
        check_serving(Annotated(), "annotated", state)
    said = str(refused.value)
    assert "traced and exported for one device, with no mesh: build the model it merges" in said
    assert "symbolic dimension" not in said


def test_an_input_example_that_breaks_a_symbolic_constraint_is_cut_until_the_export_takes_it(
    caplog,
):
    """An example taken from an eval batch of ``seq_len + 1`` tokens, for a serve of at most
    ``seq_len``: cut to fit (else MLflow's check of the example would fail the registration);
    none where no cut fits."""
    import jax.numpy as jnp

    from prefect_jax.training.registry_signature import typed_example

    b, s = jax.export.symbolic_shape("b, s", constraints=("s <= 32",))
    exported = jax.export.export(jax.jit(lambda x: x.sum(axis=1)))(
        jax.ShapeDtypeStruct((b, s), jnp.int32)
    )
    tokens = np.arange(5 * 33).reshape(5, 33)
    example = typed_example(exported, tokens)
    np.testing.assert_array_equal(example, tokens[:, :32])  # the longest that fits, same rows
    assert exported.call(example).shape == (5,)
    assert typed_example(exported, tokens[:, :7]).shape == (5, 7)  # one that fits: as it is

    b, s = jax.export.symbolic_shape("b, s", constraints=("s <= 8", "b <= 2"))
    named = jax.export.export(jax.jit(lambda x: x["a"] + x["c"]))(
        {"a": jax.ShapeDtypeStruct((b, s), jnp.int32), "c": jax.ShapeDtypeStruct((b, s), jnp.int32)}
    )
    cut = typed_example(named, {"a": tokens, "c": tokens})
    assert cut["a"].shape == cut["c"].shape and cut["a"].shape[0] <= 2 and cut["a"].shape[1] <= 8
    assert named.call(cut).shape == cut["a"].shape

    b, s = jax.export.symbolic_shape("b, s", constraints=("s >= 64",))
    longer = jax.export.export(jax.jit(lambda x: x))(jax.ShapeDtypeStruct((b, s), jnp.int32))
    with caplog.at_level("WARNING", logger="prefect_jax.registry"):
        assert typed_example(longer, tokens) is None
    assert "no input example for the MLflow model: (5, 33) breaks a constraint" in caplog.text
