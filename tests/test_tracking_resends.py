"""MLflow's client sends a request again when it loses the answer (any method, on a 5xx or a
read timeout), so a create the server already made is made twice: a second run with the job's
tag, or an experiment that now "already exists". A real ``mlflow server`` behind a proxy on
loopback that forwards each request and, once, answers 503 in place of the server's answer; or
refuses a path for good, as a store that does not let the job's user register models does."""

from __future__ import annotations

import json
import threading

import pytest
from conftest import TINY
from deployment_helpers import free_port
from fault_proxy import FaultProxy
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient
from mlflow_server import MlflowServerProcess
from process_helpers import job_args, run_cli

from prefect_jax.training.names import JOB_TAG
from prefect_jax.training.tracking import Tracker

REFUSAL = json.dumps(
    {"error_code": "PERMISSION_DENIED", "message": "this user may not create registered models"}
).encode()


class AnswerLosingProxy(FaultProxy):
    """Forwards every request to `upstream`; the first POST to a path in `lose` reaches the
    server, and its client gets a 503 instead of the answer; a request to a path in `refuse`
    never reaches it: a 403 PERMISSION_DENIED answers. `posts` counts POSTs by path."""

    def __init__(self, upstream: str, lose: set[str], refuse: set[str] = frozenset()):
        self.lose, lock = set(lose), threading.Lock()

        def refusing(method, path):
            return (403, REFUSAL, "application/json") if path in refuse else None

        def losing(method, path, answer):
            with lock:  # (one answer lost, of concurrent requests too)
                if method == "POST" and path in self.lose:  # made on the server; answer lost
                    self.lose.discard(path)
                    return 503, b"{}", "application/json"
            return None

        super().__init__(upstream, refuse=refusing, after=losing)

    @property
    def posts(self) -> dict[str, int]:
        return {path: n for (method, path), n in self.requests.items() if method == "POST"}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServerProcess(tmp_path_factory.mktemp("mlflow-server"), free_port())
    server.start()
    yield server
    server.kill()


@pytest.mark.parametrize("lost", ["experiments/create", "runs/create"])
def test_a_resent_create_leaves_one_experiment_and_one_run_and_tracking_on(
    mlflow_server, monkeypatch, lost
):
    monkeypatch.setenv("PREFECT_JAX_MLFLOW_STRICT", "1")  # a failure raises, not a warning
    monkeypatch.setenv("PREFECT_JAX_MLFLOW_IN_PROCESS", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")  # resend at once
    direct = MlflowClient(mlflow_server.uri)
    experiment = f"resent-{lost.split('/')[0]}"
    if lost == "runs/create":
        direct.create_experiment(experiment)
    path = f"/api/2.0/mlflow/{lost}"
    proxy = AnswerLosingProxy(mlflow_server.uri, {path})
    try:
        tracker = Tracker(proxy.uri, experiment, "job-a")
        tracker.start({"p": "1"})
        tracker.flush()  # strict: what failed in the start raises here
        run_id = tracker.run_id
        tracker.finish()
        tracker.close()
    finally:
        proxy.close()
    assert proxy.posts[path] == 2  # the answer was lost and the create sent again

    exp = direct.get_experiment_by_name(experiment)
    runs = direct.search_runs([exp.experiment_id], filter_string=f"tags.`{JOB_TAG}` = 'job-a'")
    assert [r.info.run_id for r in runs] == [run_id]  # the job's one run, and the tracker's
    assert runs[0].data.params == {"p": "1"} and runs[0].info.status == "FINISHED"
    deleted = direct.search_runs([exp.experiment_id], run_view_type=ViewType.DELETED_ONLY)
    assert len(deleted) == (lost == "runs/create")  # the resend's empty twin


def test_a_resent_version_create_leaves_the_step_one_version_with_its_alias(
    mlflow_server, monkeypatch, tmp_path
):
    """The step's model, logged by an attempt that died before registering it, is registered by
    the next sync; the create's answer is lost and the create sent again."""
    from prefect_jax.training.names import STEP_TAG
    from prefect_jax.training.registry import sync_registry

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    direct = MlflowClient(mlflow_server.uri)
    exp_id = direct.create_experiment("resent-version")
    run_id = direct.create_run(exp_id, tags={JOB_TAG: "job-v"}).info.run_id
    logged = direct.create_logged_model(
        exp_id, name="s5", source_run_id=run_id, tags={JOB_TAG: "job-v", STEP_TAG: "5"}
    )
    (tmp_path / "MLmodel").write_text("artifact_path: s5\nflavors: {}\n")
    direct.log_model_artifacts(logged.model_id, str(tmp_path))
    path = "/api/2.0/mlflow/model-versions/create"
    proxy = AnswerLosingProxy(mlflow_server.uri, {path})
    try:
        synced = sync_registry(
            MlflowClient(proxy.uri),
            proxy.uri,
            exp_id,
            run_id,
            "resent-model",
            "job-v",
            "job-v",
            aliases={"best": 5},
            local_export=lambda step: pytest.fail(f"step {step} was logged: nothing to export"),
            example=None,
            steps=[5],
        )
    finally:
        proxy.close()
    assert proxy.posts[path] == 2  # the answer was lost and the create sent again
    versions = direct.search_model_versions("name = 'resent-model'")
    assert [v.version for v in versions] == [synced["versions"][5]]  # the twin deleted
    assert synced["aliases"] == {"best": synced["versions"][5]}
    assert direct.get_model_version_by_alias("resent-model", "best").version == versions[0].version


def test_of_a_steps_several_versions_the_first_is_kept_and_aliased_ones_too(mlflow_server):
    """On a SQL store a search's versions carry no aliases: the model's are read."""
    from prefect_jax.training.names import STEP_TAG
    from prefect_jax.training.registry_search import one_version

    direct = MlflowClient(mlflow_server.uri)
    direct.create_registered_model("twins")
    run_id = direct.create_run(direct.create_experiment("twins")).info.run_id
    tags, source = {JOB_TAG: "job-t", STEP_TAG: "7"}, f"runs:/{run_id}/model"
    made = [direct.create_model_version("twins", source, run_id, tags) for _ in range(3)]
    direct.set_registered_model_alias("twins", "pinned", made[1].version)  # (a person's, say)
    kept = one_version(direct, "twins", "job-t", 7, made[2])
    assert kept.version == made[0].version
    left = sorted(int(v.version) for v in direct.search_model_versions("name = 'twins'"))
    assert left == [int(made[0].version), int(made[1].version)]


def test_a_jobs_versions_are_its_own_read_over_every_page_oldest_first(mlflow_server):
    """Jobs sharing a registered model's name: each reads only its versions, whatever the pages."""
    from prefect_jax.training.names import STEP_TAG
    from prefect_jax.training.registry_search import job_versions, versions_of_job

    direct = MlflowClient(mlflow_server.uri)
    direct.create_registered_model("shared")
    run_id = direct.create_run(direct.create_experiment("shared")).info.run_id
    made = {"job-a": [], "job-b": []}
    for step in range(5):
        for job in ("job-a", "job-b"):
            tags = {JOB_TAG: job, STEP_TAG: str(step * 10)}
            source = f"runs:/{run_id}/model"
            made[job].append(direct.create_model_version("shared", source, run_id, tags))
    for job, versions in made.items():
        found = versions_of_job(direct, "shared", job, page_size=2)  # three pages
        assert [v.version for v in found] == [v.version for v in versions], job
    assert {s: v.version for s, v in job_versions(direct, "shared", "job-b").items()} == {
        s * 10: v.version for s, v in enumerate(made["job-b"])
    }


def test_a_resent_logged_model_create_leaves_one_logged_model_with_the_files(
    mlflow_server, monkeypatch, tmp_path
):
    """The export's MLflow Model: a resend's empty twin deleted, the files in the one kept."""
    import jax
    import jax.numpy as jnp
    import mlflow
    import numpy as np

    from prefect_jax.training.registry import log_export_model

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    exported = jax.export.export(jax.jit(lambda x: 2.0 * x))(
        jax.ShapeDtypeStruct((2, 3), jnp.float32)
    )
    (tmp_path / "model.jax_export").write_bytes(exported.serialize())
    direct = MlflowClient(mlflow_server.uri)
    exp_id = direct.create_experiment("resent-logged-model")
    run_id = direct.create_run(exp_id, tags={JOB_TAG: "job-m"}).info.run_id
    path = "/api/2.0/mlflow/logged-models"
    proxy = AnswerLosingProxy(mlflow_server.uri, {path})
    uri_before = mlflow.get_tracking_uri()  # (log_export_model sets MLflow's global one)
    try:
        model_id = log_export_model(
            MlflowClient(proxy.uri),
            proxy.uri,
            exp_id,
            run_id,
            "job",
            "job-m",
            3,
            str(tmp_path),
            np.ones((2, 3), np.float32),
        )
        # (MLflow caches a model's artifact store by id, process-wide: here, the proxy's)
        files = {f.path for f in direct.list_logged_model_artifacts(model_id)}
    finally:
        mlflow.set_tracking_uri(uri_before)
        proxy.close()
    assert proxy.posts[path] == 2  # the answer was lost and the create sent again
    models = direct.search_logged_models([exp_id])
    assert [m.model_id for m in models] == [model_id]  # the twin deleted
    assert "MLmodel" in files, files


@pytest.mark.slow
def test_a_job_whose_exports_mlflow_refuses_to_register_says_so_and_export_registers_them_later(
    mlflow_server, tmp_path
):
    """A store that lets the job's user log runs but not create registered models (403): the job
    trains, evaluates and exports (tracking never stops training), and its summary says which
    exports are not versions and how to register them, instead of a ``models:/...@best`` that
    does not exist. `prefect-jax export`, once MLflow takes them, registers them."""
    refused = "/api/2.0/mlflow/registered-models/create"
    proxy = AnswerLosingProxy(mlflow_server.uri, set(), refuse={refused})
    storage = tmp_path / "s"
    try:
        args = job_args(TINY, "refused", storage, 20, 10, proxy.uri, "--registered-model", "rf")
        proc = run_cli("run", *args, PREFECT_JAX_MLFLOW_STRICT="0")
    finally:
        proxy.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["final_step"] == 20 and summary["exports"]["final"] == [20]
    missing = summary["registry_missing"]
    assert missing.startswith("steps 10, 20 are exported but not versions of registered model rf")
    assert "prefect-jax export" in missing and f"--storage {storage}" in missing, missing
    browse = "\n".join(summary["browse"])
    assert "models:/rf@" not in browse and f"Serve:   {missing}" in browse, browse

    proc = run_cli(
        "export",
        *("--program", TINY, "--job", "refused", "--storage", str(storage)),
        *("--registered-model", "rf", "--mlflow-tracking-uri", mlflow_server.uri, "--json"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    direct = MlflowClient(mlflow_server.uri)
    versions = direct.search_model_versions("name = 'rf'")
    assert sorted(int(v.tags["prefect_jax.step"]) for v in versions) == [10, 20]
    assert set(direct.get_registered_model("rf").aliases) == {"best", "final", "newest"}
