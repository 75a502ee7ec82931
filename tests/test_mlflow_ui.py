"""What a team sees in MLflow's UI, in a real browser: a job tracked on a real `mlflow server`
(loopback, SQLite, proxied artifacts), its run page with the eval curve, the description and
the logged models, and the registered model's page with its aliases. Screenshots go to
test-output/browser/mlflow-*.png."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from browser_helpers import OUTPUT, browser_page
from conftest import train_to_end
from deployment_helpers import free_port
from mlflow.tracking import MlflowClient

pytestmark = [pytest.mark.slow, pytest.mark.browser]

JOB, MODEL = "ui-job", "ui-digits"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = open(home / "server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{home}/mlflow.db",
            "--artifacts-destination",
            str(home / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its workers go with it
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (home / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise TimeoutError((home / "server.log").read_text()[-3000:])
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a loaded machine: SIGKILL below ends it
            pass
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            log.close()


@pytest.fixture(scope="module")
def tracked_job(mlflow_server, tmp_path_factory):
    """A 60-step job tracked on the server, with system metrics sampled every second."""
    from prefect_jax.training.specs import (
        BestExporter,
        CheckpointSpec,
        EvalSpec,
        FinalExporter,
        JobConfig,
        LatestExporter,
        TrainSpec,
    )
    from prefect_jax.training.trainer import Trainer

    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    try:
        config = JobConfig(
            program="prefect_jax.examples.digits:tiny",
            job=JOB,
            storage=str(tmp_path_factory.mktemp("ui") / "storage"),
            train=TrainSpec(max_steps=60, log_every_steps=10),
            checkpoint=CheckpointSpec(every_steps=20),
            eval=EvalSpec(
                exporters=[LatestExporter(), BestExporter(), FinalExporter()],
                registered_model=MODEL,
            ),
            mlflow_tracking_uri=mlflow_server,
        )
        trainer = Trainer(config)
        trainer.restore_or_init()
        train_to_end(trainer)
        time.sleep(2)  # a few system-metric samples
        url, run_id = trainer.job.tracker.run_url(), trainer.job.tracker.run_id
        trainer.finish()
        trainer.close()
    finally:
        mp.undo()
    return url, run_id


def test_the_run_page_shows_the_description_eval_curves_and_logged_models(
    mlflow_server, tracked_job
):
    run_url, run_id = tracked_job
    assert run_url.startswith(mlflow_server) and run_url.endswith("?workflowType=machine_learning")
    run = MlflowClient(mlflow_server).get_run(run_id)
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics), sorted(
        run.data.metrics
    )

    with browser_page() as page:
        page.goto(run_url, wait_until="load")
        page.get_by_text(f"{JOB}-step-60").first.wait_for(
            timeout=60_000
        )  # the logged models of the metrics
        text = page.inner_text("body")
        page.screenshot(path=str(OUTPUT / "mlflow-run.png"), full_page=True)
        assert "Model training" in text and "Training runs" not in text, (
            "the run opens in the model-training view"
        )
        assert f"prefect-jax job {JOB}" in text and "eval/accuracy" in text and "train/loss" in text

        page.goto(
            run_url.replace(f"/runs/{run_id}?", f"/runs/{run_id}/model-metrics?"), wait_until="load"
        )
        page.get_by_text(f"{JOB} (eval/accuracy)").first.wait_for(
            timeout=60_000
        )  # the eval chart's legend
        page.screenshot(path=str(OUTPUT / "mlflow-charts.png"), full_page=True)


def test_the_registered_model_page_shows_its_versions_and_aliases(mlflow_server, tracked_job):
    client = MlflowClient(mlflow_server)
    aliases = client.get_registered_model(MODEL).aliases
    assert set(aliases) == {"best", "final", "newest"}
    with browser_page() as page:
        page.goto(
            f"{mlflow_server}/#/models/{MODEL}?workflowType=machine_learning", wait_until="load"
        )
        page.get_by_text("Version 3").first.wait_for(timeout=60_000)
        for alias in aliases:
            page.get_by_text(f"@\u00a0{alias}", exact=True).first.wait_for(
                timeout=60_000
            )  # the alias chips
        text = page.inner_text("body")
        page.screenshot(path=str(OUTPUT / "mlflow-registered-model.png"), full_page=True)
    # Each version row: its step, then the aliases on it.
    rows = {v.version: v for v in client.search_model_versions(f"name = '{MODEL}'")}
    for alias, version in aliases.items():
        step = rows[version].tags["prefect_jax.step"]
        row = text[text.index(f"Version {version}\n") :]
        assert (
            f"prefect_jax.step\n: {step}\n" in row
            and f"@\u00a0{alias}" in row.split("\nVersion ")[0]
        ), (alias, row[:300])
    assert f"job {JOB}, step 60" in text and f"job {JOB}, step 20" in text


def test_from_the_home_page_the_experiment_opens_in_model_training_once_the_switch_says_so(
    mlflow_server, tracked_job
):
    """What docs/mlflow.md tells a person who browses in from MLflow's home page: MLflow 3.17's UI
    picks the view from its sidebar switch (GenAI / Model training), remembered by the browser,
    not from the experiment (prefect-jax tags it `mlflow.experimentKind` =
    `custom_model_development` all the same); one click on "Model training" and the experiment
    opens in its training runs, then and after a fresh visit of the home page."""
    from prefect_jax.training.names import DEFAULT_EXPERIMENT

    _, run_id = tracked_job
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name(DEFAULT_EXPERIMENT)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = f"/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning"
    with browser_page() as page:
        page.goto(f"{mlflow_server}/", wait_until="load")
        page.get_by_text("Model training", exact=True).first.click()
        # (remembered by the browser: the next page may load only once that is so)
        page.wait_for_function(
            "() => (localStorage.getItem('mlflow.workflowType_v1') || '')"
            ".includes('machine_learning')",
            timeout=60_000,
        )
        for visit in ("switched", "remembered"):
            page.goto(f"{mlflow_server}/", wait_until="load")
            page.get_by_text(DEFAULT_EXPERIMENT, exact=True).first.click()
            page.wait_for_url(f"**{runs}", timeout=60_000)
            page.get_by_text(JOB, exact=True).first.wait_for(timeout=60_000)  # the job's run
            page.screenshot(path=str(OUTPUT / f"mlflow-home-{visit}.png"), full_page=True)
            assert "workflowType=genai" not in page.url, (visit, page.url)
