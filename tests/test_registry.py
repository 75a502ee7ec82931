"""Exports as MLflow Models in the Model Registry: one version per exported step, aliases moved by
the exporters, nothing registered twice on a rerun, and `models:/<job>@best` served by a fresh
process that cannot import prefect-jax, exactly as the in-process serving function predicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import train_to_end
from mlflow.tracking import MlflowClient

from prefect_jax.training.evaluation import EvalStatus
from prefect_jax.training.exporters import load_export, serving_example
from prefect_jax.training.specs import BestExporter, FinalExporter, LatestExporter
from prefect_jax.training.trainer import Trainer

EXPORTERS = [LatestExporter(), BestExporter(metric="accuracy", mode="max"), FinalExporter()]


@pytest.fixture(scope="module")
def registered(tmp_path_factory, mlflow_uri):
    """A 60-step tiny job (evaluated and exported at 20, 40, 60) and its registry."""
    from prefect_jax.training.specs import CheckpointSpec, EvalSpec, JobConfig, TrainSpec

    storage = tmp_path_factory.mktemp("registry") / "storage"
    config = JobConfig(
        program="prefect_jax.examples.digits:tiny", job="reg", storage=str(storage), train=TrainSpec(max_steps=60, log_every_steps=10),
        checkpoint=CheckpointSpec(every_steps=20), eval=EvalSpec(exporters=EXPORTERS, registered_model="reg-digits", learning_curve_every_secs=0),
        mlflow_tracking_uri=mlflow_uri,
    )  # fmt: skip
    trainer = Trainer(config)
    trainer.restore_or_init()
    results = train_to_end(trainer)
    run_id = trainer.tracker.run_id
    trainer.finish()
    trainer.close()
    return config, results, run_id


def _versions(client, name="reg-digits"):
    return {int(v.tags["prefect_jax.step"]): v for v in client.search_model_versions(f"name = '{name}'")}


def test_every_exported_step_is_one_version_and_the_exporters_move_their_aliases(registered, mlflow_uri):
    config, results, run_id = registered
    client = MlflowClient(mlflow_uri)
    versions = _versions(client)
    assert sorted(versions) == [20, 40, 60]
    best = min(results, key=lambda r: (-r.metrics["accuracy"], r.step)).step
    aliases = client.get_registered_model("reg-digits").aliases
    assert aliases == {"newest": versions[60].version, "final": versions[60].version, "best": versions[best].version}

    # Each version's source is an MLflow Model logged to the job's run at its step, with a signature.
    for step, version in versions.items():
        assert version.run_id == run_id and version.source.startswith("models:/m-")
        model = client.get_logged_model(version.source.removeprefix("models:/"))
        assert model.source_run_id == run_id and model.tags["prefect_jax.step"] == str(step)
    outputs = client.get_run(run_id).outputs.model_outputs
    assert sorted((o.step, f"models:/{o.model_id}") for o in outputs) == sorted((s, v.source) for s, v in versions.items())

    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)  # the trainer's MLflow calls ran in its worker process, not here
    info = mlflow.models.get_model_info("models:/reg-digits@best")
    assert info.signature.inputs.to_dict()[0]["tensor-spec"]["shape"] == (-1, 64)
    assert info.signature.outputs.to_dict()[0]["tensor-spec"]["shape"] == (-1, 10)

    status = json.loads(_cli("status", "--job", "reg", "--storage", config.storage, "--json").stdout.splitlines()[-1])
    assert status["registered_model"]["name"] == "reg-digits"
    assert status["registered_model"]["aliases"] == {a: str(v) for a, v in aliases.items()}
    assert status["registered_model"]["versions"] == {str(s): str(v.version) for s, v in versions.items()}


def test_a_rerun_registers_nothing_twice(registered, mlflow_uri):
    config, results, run_id = registered
    client = MlflowClient(mlflow_uri)
    before = {s: v.version for s, v in _versions(client).items()}
    logged_before = len(client.get_run(run_id).outputs.model_outputs)

    again = Trainer(config)  # a rerun: the job is done; the last result is found, re-exported, re-synced
    try:
        assert again.restore_or_init() == 60
        result = again.evaluate_if_new()
        assert result.status == EvalStatus.NO_NEW_CHECKPOINT
        again.export(result)
        again.tracker.flush()
    finally:
        again.finish()
        again.close()
    assert {s: v.version for s, v in _versions(client).items()} == before
    assert len(client.get_run(run_id).outputs.model_outputs) == logged_before


FRESH = r"""
import json, sys
sys.modules["prefect_jax"] = None  # importing prefect-jax (or the program's module) fails here
import mlflow, numpy as np
model = mlflow.pyfunc.load_model(sys.argv[1])
x = np.load(sys.argv[2])
print(json.dumps({"y": model.predict(x).tolist(), "modules": sorted(m for m, mod in sys.modules.items() if m.startswith("prefect") and mod is not None)}))
"""


def test_a_fresh_process_without_prefect_jax_serves_models_best_exactly(registered, mlflow_uri, tmp_path):
    config, results, _ = registered
    from prefect_jax.training.program import load_program

    program = load_program(config.program)
    x = serving_example(program, rows=7)
    np.save(tmp_path / "x.npy", x)
    best = min(results, key=lambda r: (-r.metrics["accuracy"], r.step)).step
    in_process = np.asarray(load_export(os.path.join(config.storage, "reg", "exports", "best", str(best)))(x))

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MLFLOW_TRACKING_URI"] = mlflow_uri
    proc = subprocess.run([sys.executable, "-c", FRESH, "models:/reg-digits@best", str(tmp_path / "x.npy")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["modules"] == []
    served = np.asarray(out["y"], dtype=in_process.dtype)
    assert served.shape == (7, 10)
    np.testing.assert_array_equal(served, in_process)

    # And the serving function itself, on the state of that step, in this process.
    trainer = Trainer(config)
    try:
        state = trainer.job.restore(best, trainer.abstract_state)[0]
        np.testing.assert_allclose(served, np.asarray(program.serve(state, x)), rtol=1e-6, atol=1e-7)
    finally:
        trainer.close()


def test_a_model_trained_anywhere_loads_on_cpus_gpus_and_tpus_and_says_so(registered, mlflow_uri):
    import jax
    import mlflow

    config, results, _ = registered
    final = results[-1].step
    with open(os.path.join(config.storage, "reg", "exports", "final", str(final), "model.jax_export"), "rb") as f:
        assert jax.export.deserialize(bytearray(f.read())).platforms == ("cpu", "cuda", "tpu")
    mlflow.set_tracking_uri(mlflow_uri)
    assert mlflow.models.get_model_info("models:/reg-digits@final").metadata["prefect_jax"]["platforms"] == ["cpu", "cuda", "tpu"]


def _export_job(job_config, job, program="programs:here_only_serve", **eval_updates):
    config = job_config(max_steps=20, job=job, exporters=[LatestExporter()], program=program)
    config = config.model_copy(update={"eval": config.eval.model_copy(update={"registered_model": job, **eval_updates})})
    trainer = Trainer(config)
    trainer.restore_or_init()
    train_to_end(trainer)
    trainer.finish()
    trainer.close()
    return os.path.join(config.storage, job, "exports", "latest", "20")


def test_a_serve_that_lowers_only_here_is_exported_for_here_with_a_warning_and_a_named_platform_list_is_kept(
    job_config, mlflow_uri, caplog
):
    import jax
    import mlflow

    from prefect_jax.training.exporters import serialize_serving

    here = jax.export.default_export_platform()  # "cpu" in CI
    mlflow.set_tracking_uri(mlflow_uri)
    with caplog.at_level("WARNING", logger="prefect_jax.trainer"):
        path = _export_job(job_config, "here-only")
    assert f"the export runs on {here} only" in caplog.text and "here_only_identity" in caplog.text
    with open(os.path.join(path, "model.jax_export"), "rb") as f:
        assert jax.export.deserialize(bytearray(f.read())).platforms == (here,)
    assert mlflow.models.get_model_info("models:/here-only@newest").metadata["prefect_jax"]["platforms"] == [here]

    # Named platforms are the user's: no fallback, and an error that names them and the fix.
    from programs import here_only_serve

    program = here_only_serve()
    state = jax.jit(program.init)(jax.random.key(0))
    other = "tpu" if here != "tpu" else "cpu"
    with pytest.raises(ValueError, match=rf"export_platforms=\['{here}', '{other}'\].*here_only_identity.*\['{here}'\] for this machine's alone"):
        serialize_serving(program, state, [here, other])


def test_an_export_for_accelerators_only_is_still_logged_and_a_cpu_says_where_it_runs(job_config, mlflow_uri):
    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)
    path = _export_job(job_config, "tpu-only", "prefect_jax.examples.digits:tiny", export_platforms=["tpu"])  # lowers here; the MLflow worker runs it nowhere
    info = mlflow.models.get_model_info("models:/tpu-only@newest")
    assert info.metadata["prefect_jax"]["platforms"] == ["tpu"]
    assert list(info.signature.outputs.to_dict()[0]["tensor-spec"]["shape"]) == [-1, 10]
    with pytest.raises(Exception, match="tpu"):
        load_export(path)(np.zeros((2, 64), np.float32))


ON_AN_ACCELERATOR_HOST = r"""
import os, sys
import jax
jax.devices()  # this process's JAX is open, on the CPU here
os.environ["JAX_PLATFORMS"] = "cuda"  # as on a GPU pool: the MLflow worker is given this environment
from prefect_jax.training.specs import CheckpointSpec, EvalSpec, JobConfig, LatestExporter, TrainSpec
from prefect_jax.training.trainer import Trainer
config = JobConfig(program="prefect_jax.examples.digits:tiny", job="accel", storage=sys.argv[1],
                   train=TrainSpec(max_steps=20, log_every_steps=10), checkpoint=CheckpointSpec(every_steps=20),
                   eval=EvalSpec(exporters=[LatestExporter()], registered_model="accel", learning_curve_every_secs=0),
                   mlflow_tracking_uri=sys.argv[2])
trainer = Trainer(config)
trainer.restore_or_init()
trainer.train_until_checkpoint()
trainer.export(trainer.evaluate_if_new())
trainer.finish()
trainer.close()
"""


def test_the_mlflow_worker_checks_a_logged_model_on_the_cpu_not_on_the_trainers_accelerator(tmp_path, mlflow_uri):
    """On a GPU host a second JAX client (the MLflow worker's, checking the logged model) would take
    the GPU's memory beside the trainer's; it runs on the CPU, whatever JAX_PLATFORMS the job has."""
    proc = subprocess.run([sys.executable, "-c", ON_AN_ACCELERATOR_HOST, str(tmp_path / "storage"), mlflow_uri],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    versions = MlflowClient(mlflow_uri).search_model_versions("name = 'accel'")
    assert [v.tags["prefect_jax.step"] for v in versions] == ["20"], proc.stderr[-3000:]


def test_the_run_reads_as_model_training(registered, mlflow_uri):
    import jax

    config, _, run_id = registered
    client = MlflowClient(mlflow_uri)
    run = client.get_run(run_id)
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert {"train/loss", "train/accuracy", "eval/loss", "eval/accuracy"} <= set(run.data.metrics)
    assert "loss" not in run.data.metrics and "accuracy" not in run.data.metrics
    assert run.data.tags["prefect_jax.devices"] == f"1 x {jax.devices()[0].device_kind} ({jax.default_backend()})"  # 1 x cpu (cpu)
    note = run.data.tags["mlflow.note.content"]
    assert "prefect-jax job `reg`" in note and config.storage in note and "/checkpoints/<step>" in note
    images = [f.path for f in client.list_artifacts(run_id, "images")]
    assert len([p for p in images if "learning_curve" in p and p.endswith(".png")]) == 3, images


def _cli(*args):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.run([sys.executable, "-m", "prefect_jax.cli", *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_an_export_a_killed_process_never_registered_is_registered_by_the_next_sync(job_config, monkeypatch, mlflow_uri):
    from prefect_jax.training.tracking import Tracker

    config = job_config(max_steps=40, exporters=[LatestExporter()])
    config = config.model_copy(update={"eval": config.eval.model_copy(update={"registered_model": "catch-up"})})
    trainer = Trainer(config)
    trainer.restore_or_init()
    with monkeypatch.context() as m:  # step 20 is exported, then the process dies before its MLflow thread registers it
        m.setattr(Tracker, "register_exports", lambda self, *args, **kwargs: None)
        trainer.train_until_checkpoint()
        trainer.export(trainer.evaluate_if_new())
    trainer.train_until_checkpoint()
    trainer.export(trainer.evaluate_if_new())
    trainer.finish()
    trainer.close()
    client = MlflowClient(mlflow_uri)
    versions = {s: str(v.version) for s, v in _versions(client, "catch-up").items()}
    assert versions == {20: "1", 40: "2"}  # in step order
    assert {a: str(v) for a, v in client.get_registered_model("catch-up").aliases.items()} == {"newest": "2"}


def test_a_model_logged_by_a_killed_process_is_registered_not_logged_again(job_config, monkeypatch, mlflow_uri, tmp_path):
    import mlflow

    from prefect_jax.training import registry
    from prefect_jax.training.tracking import Tracker

    config = job_config(max_steps=40, exporters=[LatestExporter()])
    config = config.model_copy(update={"eval": config.eval.model_copy(update={"registered_model": "half-done"})})
    trainer = Trainer(config)
    trainer.restore_or_init()

    def log_only(self, name, job, aliases, local_export, example, **kwargs):  # killed between the log and the version
        registry.log_export_model(self.client, self.tracking_uri, self.experiment_id, self.run_id, job, self.job_key, 20,
                                  local_export(20), example)  # fmt: skip

    with monkeypatch.context() as m:
        m.setattr(Tracker, "register_exports", log_only)
        trainer.train_until_checkpoint()
        trainer.export(trainer.evaluate_if_new())
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/elsewhere.db")  # a fresh process knows no tracking URI
    try:
        trainer.train_until_checkpoint()
        trainer.export(trainer.evaluate_if_new())
        trainer.finish()
    finally:
        trainer.close()
        mlflow.set_tracking_uri(before)
    client = MlflowClient(mlflow_uri)
    assert {s: str(v.version) for s, v in _versions(client, "half-done").items()} == {20: "1", 40: "2"}
    run = client.get_run(trainer.tracker.run_id)
    models = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'")
    assert sorted(m.tags["prefect_jax.step"] for m in models) == ["20", "40"]  # step 20 logged once
