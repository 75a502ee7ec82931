"""What a person sees in the Prefect UI, checked in a real browser (Debian's chromium driven by
Playwright) against a real `prefect server` on loopback, after a real `prefect-jax run`.

Screenshots go to ``test-output/browser/`` (or ``$PREFECT_JAX_TEST_OUTPUT/browser``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from browser_helpers import OUTPUT, browser_page
from deployment_helpers import ROOT, PrefectServerProcess, _base_env

from prefect_jax.tasks.publish import job_artifact_key

pytestmark = [pytest.mark.slow, pytest.mark.browser]

TINY = "prefect_jax.examples.digits:tiny"


@pytest.fixture(scope="module")
def page():
    with browser_page() as page:
        yield page


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory):
    server = PrefectServerProcess(tmp_path_factory.mktemp("ui-server"), ui=True)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def _flow_run_id(api_url: str, job: str) -> str:
    """Over the REST API (Playwright's sync API owns this thread's event loop)."""
    import httpx

    runs = httpx.post(
        f"{api_url}/flow_runs/filter",
        json={"flow_runs": {"name": {"any_": [f"train-and-evaluate-{job}"]}}},
    ).json()
    return runs[0]["id"]


def test_a_flow_run_page_shows_step_named_task_runs_and_the_artifacts(
    ui_server, page, tmp_path, mlflow_uri
):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect_jax.cli",
            "run",
            "--program",
            TINY,
            "--job",
            "ui-job",
            "--storage",
            str(tmp_path / "storage"),
            "--max-steps",
            "40",
            "--checkpoint-every-steps",
            "20",
            "--mlflow-tracking-uri",
            mlflow_uri,
            "--json",
            "--no-progress",
        ],
        env=_base_env(PREFECT_API_URL=ui_server.api_url),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["final_step"] == 40

    flow_run = f"{ui_server.ui_url}/runs/flow-run/{_flow_run_id(ui_server.api_url, 'ui-job')}"
    page.goto(flow_run, wait_until="networkidle")
    page.get_by_text("Completed").first.wait_for(timeout=60_000)
    page.screenshot(path=str(OUTPUT / "flow-run.png"), full_page=True)

    page.get_by_text("Task Runs", exact=True).first.click()
    for name in (
        "restore or init ui-job",
        "train 0 to 20",
        "train 20 to 40",
        "evaluate 20",
        "evaluate 40",
        "export 40",
    ):
        page.get_by_text(name, exact=True).first.wait_for(timeout=60_000)
    page.screenshot(path=str(OUTPUT / "flow-run-task-runs.png"), full_page=True)

    page.get_by_text("Artifacts", exact=True).first.click()
    key = lambda part: job_artifact_key("ui-job", str(tmp_path / "storage"), part)  # noqa: E731
    page.get_by_text(key("eval-results")).first.wait_for(timeout=60_000)
    page.get_by_text(key("mlflow-run")).first.wait_for(timeout=60_000)  # the link to MLflow's run
    page.get_by_text(key("goodput")).first.wait_for(timeout=60_000)  # what the job's time went into
    body = page.inner_text("body")
    assert "training ui-job: step 40 of 40" in body, body[-2000:]
    page.screenshot(path=str(OUTPUT / "flow-run-artifacts.png"), full_page=True)
