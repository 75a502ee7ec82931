"""Reruns the way users do them: a deployment run killed mid-run, retried from the Prefect UI.

A real ``prefect server start`` with its UI and a ``serve`` process (both started here) run the
`train_and_evaluate` deployment. Once a checkpoint is committed, the deployment run's process is
SIGKILLed (no handler runs; serve, its worker, lives on and reports it Crashed). A person opens
the run in a real browser (Debian's chromium), sees Crashed, clicks Retry and confirms; serve
runs it again. (A machine lost with its worker: tests/test_sigkill_leftovers.py.) The retried run
must take over the dead trainer's lease, resume at the newest committed step (nothing retrained
from 0, no step logged or evaluated twice) and end with the same state fingerprint as an
uninterrupted run of the same job config.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from browser_helpers import retry_in_the_ui, screenshot_flow_run
from deployment_helpers import (
    DEPLOYMENT,
    ROOT,
    PrefectServerProcess,
    ServeProcess,
    checkpoint_fingerprint,
    dead,
    deployment_params,
    deployment_runs,
    job_config,
    logs,
    start_deployment_run,
    uninterrupted_fingerprint,
    wait_for_deployments,
)
from process_helpers import settled_task_runs

pytestmark = [pytest.mark.slow, pytest.mark.browser]

TINY = "prefect_jax.examples.digits:tiny"
MAX_STEPS = 800
EVERY = 100
LOG_EVERY = 50
KILL_FROM = 200  # SIGKILL once this step (or a later one) is committed: training is not over


def _params(storage: Path, job: str, mlflow_uri: str) -> dict:
    """The deployment run's parameters, JSON as a user would type them in the UI."""
    return deployment_params(TINY, job, storage, mlflow_uri, MAX_STEPS, EVERY, LOG_EVERY)


def _wait_for_commit(
    checkpoint_dir: Path, at_least: int, client, flow_run_id, serve: ServeProcess, timeout: float
) -> int:
    """Poll (every 20 ms) until a step >= `at_least` is committed; fail fast if the run ends
    first."""
    from prefect_jax.training.checkpoint_dirs import committed_steps

    deadline = time.monotonic() + timeout
    next_check = 0.0
    while time.monotonic() < deadline:
        steps = committed_steps(str(checkpoint_dir)) if checkpoint_dir.exists() else []
        if steps and steps[-1] >= at_least:
            return steps[-1]
        if time.monotonic() >= next_check:
            state = client.read_flow_run(flow_run_id).state
            assert serve.alive() and not state.is_final(), (
                f"the run ended before step {at_least}: {state}\n{logs(serve)}"
            )
            next_check = time.monotonic() + 1.0
        time.sleep(0.02)
    raise AssertionError(f"no committed step >= {at_least} after {timeout:.0f}s\n{logs(serve)}")


def _wait_final(client, flow_run_id, serve: ServeProcess, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.read_flow_run(flow_run_id)
        if run.state.is_final():
            return run
        assert serve.alive(), f"serve exited while the retried run is {run.state}\n{logs(serve)}"
        time.sleep(0.5)
    raise AssertionError(
        f"the retried run is still {client.read_flow_run(flow_run_id).state} after "
        f"{timeout:.0f}s\n{logs(serve)}"
    )


def _status(job: str, storage: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect_jax.cli",
            "status",
            "--job",
            job,
            "--storage",
            str(storage),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(540)
def test_a_killed_deployment_run_retried_from_the_ui_resumes_and_ends_exactly(tmp_path, processes):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    from prefect_jax.training.checkpoint_dirs import committed_steps
    from prefect_jax.training.names import JOB_TAG
    from prefect_jax.training.storage import JobStorage

    server = PrefectServerProcess(tmp_path / "prefect-server", ui=True)
    processes.append(server)

    # While the server starts: the uninterrupted run of the same job config in other storage (it
    # also creates the MLflow tables, which takes seconds; the two jobs get one MLflow run each).
    storage, job, mlflow_uri = tmp_path / "storage", "rerun", f"sqlite:///{tmp_path}/mlflow.db"
    params = _params(storage, job, mlflow_uri)
    reference = job_config(_params(tmp_path / "reference", job, mlflow_uri))
    expected = uninterrupted_fingerprint(reference)
    assert checkpoint_fingerprint(reference, MAX_STEPS)[0] == expected

    server.wait_healthy()
    job_dir = storage / job
    results = (
        tmp_path / "results"
    )  # flow results persisted, so the summary the flow returned can be read back
    serve_env = {
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
        "PREFECT_LOCAL_STORAGE_PATH": str(results),
    }
    with (
        temporary_settings({PREFECT_API_URL: server.api_url, PREFECT_LOCAL_STORAGE_PATH: results}),
        get_client(sync_client=True) as client,
    ):
        first = ServeProcess(
            server.api_url, tmp_path / "serve-home", tmp_path / "serve-1.log", **serve_env
        )
        processes.append(first)
        wait_for_deployments(client, first, [f"train_and_evaluate/{DEPLOYMENT}"])[
            f"train_and_evaluate/{DEPLOYMENT}"
        ]
        flow_run = start_deployment_run(f"train_and_evaluate/{DEPLOYMENT}", params)

        # The deployment run is SIGKILLed mid-run (its flow-run process; serve lives on).
        _wait_for_commit(
            job_dir / "checkpoints", KILL_FROM, client, flow_run.id, first, timeout=180
        )
        lease = json.loads((job_dir / "lease.json").read_text())
        flow_run_pids = first.children()
        assert lease["pid"] in flow_run_pids and lease["flow_run_id"] == str(flow_run.id), (
            lease,
            flow_run_pids,
            deployment_runs(client, flow_run.id),
            logs(first, server),
        )
        os.kill(lease["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not dead(lease["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dead(lease["pid"])

        committed = committed_steps(str(job_dir / "checkpoints"))
        resume_from = committed[-1]
        assert KILL_FROM <= resume_from < MAX_STEPS, (
            f"the kill did not land mid-run: committed {committed}"
        )
        left = json.loads((job_dir / "lease.json").read_text())
        assert left["pid"] == lease["pid"], "a SIGKILLed trainer leaves its lease behind"
        deadline = (
            time.monotonic() + 60
        )  # serve saw its child die: the server shows the run Crashed
        while not (killed := client.read_flow_run(flow_run.id)).state.is_crashed():
            assert time.monotonic() < deadline, f"the killed run is {killed.state}\n{logs(first)}"
            time.sleep(0.5)

        # What the user sees and does: the run Crashed; Retry, in the UI. Serve runs it again.
        retry_in_the_ui(server.ui_url, str(flow_run.id), shots="deployment-run")
        done = _wait_final(client, flow_run.id, first, timeout=240)
        assert done.state.is_completed(), f"{done.state}\n{logs(first)}"
        assert done.run_count == 2
        summary = done.state.result()
        runs = settled_task_runs(
            flow_run.id, f"train {MAX_STEPS - EVERY} to {MAX_STEPS}", client=client
        )
        resumed = f"train {resume_from} to {resume_from + EVERY}"
        page = screenshot_flow_run(
            server.ui_url, str(flow_run.id), "deployment-run-completed", "Completed", resumed
        )
    # The crashed attempt's task runs are not left Running (the retry that
    # took the lease over marked them).
    assert not [r.name for r in runs if r.state.is_running() or r.state.is_pending()], [
        (r.name, r.state) for r in runs
    ]
    assert resumed in page

    # Same end as the uninterrupted run: the flow's own summary, and its final checkpoint.
    assert summary["final_step"] == MAX_STEPS
    assert summary["state_fingerprint"] == expected
    config = job_config(params)
    fingerprint, meta = checkpoint_fingerprint(config, MAX_STEPS)
    assert fingerprint == expected
    assert meta["prefect.flow_run_id"] == str(flow_run.id) and meta["pid"] != lease["pid"]

    # The retry resumed at the newest committed step: it trained only the intervals after it.
    trained = {
        n: [r.name for r in runs if r.flow_run_run_count == n and r.name.startswith("train ")]
        for n in (1, 2)
    }
    assert trained[1][0] == f"train 0 to {EVERY}"
    assert trained[2] == [
        f"train {s} to {s + EVERY}" for s in range(resume_from, MAX_STEPS, EVERY)
    ], trained
    retried = [r for r in runs if r.flow_run_run_count == 2]
    assert retried[0].name == f"restore or init {job}" and all(
        r.state.is_completed() for r in retried
    )

    # It took over the dead trainer's lease, and released it at the end.
    assert "taking over the lease" in first.tail(200_000), logs(first)
    assert not (job_dir / "lease.json").exists()

    # Every step committed, each checkpoint evaluated once, one MLflow
    # run with each step logged once.
    status = _status(job, storage)
    assert MAX_STEPS in status["committed_steps"]
    assert status["evaluated_steps"] == {"eval": list(range(EVERY, MAX_STEPS + 1, EVERY))}
    mlflow = MlflowClient(params["mlflow_tracking_uri"])
    experiment = mlflow.get_experiment_by_name("prefect-jax")
    key = JobStorage(str(storage), job).job_dir
    (mlflow_run,) = mlflow.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{key}'"
    )
    assert (
        mlflow_run.info.run_id == summary["mlflow_run_id"] and mlflow_run.info.status == "FINISHED"
    )
    run_id = mlflow_run.info.run_id
    assert sorted(m.step for m in mlflow.get_metric_history(run_id, "train/loss")) == list(
        range(LOG_EVERY, MAX_STEPS + 1, LOG_EVERY)
    )
    assert sorted(m.step for m in mlflow.get_metric_history(run_id, "eval/accuracy")) == list(
        range(EVERY, MAX_STEPS + 1, EVERY)
    )
