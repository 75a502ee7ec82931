"""The trainer deployed on a process worker, SIGKILLed, rerun by the rerun automation, and the
same flow run started twice: one process trains the job at a time, and it ends exactly.

The README's setup, for real: a ``prefect server``, a ``process`` work pool, the `train` flow
deployed to it, `prefect_jax.deployments.automations`' rerun automation and ``prefect worker
start --pool cpu`` (polling every second, ``PREFECT_WORKER_QUERY_SECONDS=1``). The run's
process is SIGKILLed once a checkpoint is committed.

Prefect 3.8's process worker reports one SIGKILLed run Crashed twice, 1-2 s apart (its runner,
then the worker itself); the automation reacts to each Crashed, so a worker that polls between
the two starts the flow run again while its rerun already runs: two processes of one flow run.
With the default 10 s poll that happens to about one crash in five; with a 1 s poll to most.
The test also makes it certain: once the rerun trains, it sets the run AwaitingRetry again, as
the automation does on the late report. Before the lease waited for a live process of its own
flow run, both processes trained and wrote the same steps (Orbax: "Directory not empty"), and
the run ended Failed, which the automation does not rerun.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest
from deployment_helpers import (
    HERE,
    PrefectServerProcess,
    checkpoint_fingerprint,
    dead,
    deployment_params,
    job_config,
    trainer_on_process_worker,
    uninterrupted_fingerprint,
    until,
)

pytestmark = pytest.mark.slow

# 10 ms a step: 1500 steps train for ~15 s, long enough to start a second process meanwhile
PROGRAM = "programs:paced"
MAX_STEPS, EVERY, LOG_EVERY = 1500, 100, 50
KILL_FROM = 200


def _params(storage: Path, mlflow_uri: str) -> dict:
    return deployment_params(PROGRAM, "on-worker", storage, mlflow_uri, MAX_STEPS, EVERY, LOG_EVERY)


def _lease(job_dir: Path) -> dict | None:
    try:
        return json.loads((job_dir / "lease.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


@pytest.mark.timeout(600)
def test_a_killed_trainer_on_a_process_worker_started_twice_by_the_automation_trains_in_one_process(
    tmp_path, processes
):
    import psutil
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import AwaitingRetry

    from prefect_jax.training.checkpoint_dirs import committed_steps
    from prefect_jax.training.goodput import read_ledger
    from prefect_jax.training.storage import JobStorage

    server = PrefectServerProcess(tmp_path / "server")
    processes.append(server)
    mlflow_uri = f"sqlite:///{tmp_path}/mlflow.db"
    params = _params(tmp_path / "storage", mlflow_uri)
    sys.path.insert(0, str(HERE))  # programs:paced, for the reference run here
    expected = uninterrupted_fingerprint(
        job_config(_params(tmp_path / "reference", f"sqlite:///{tmp_path}/reference.db"))
    )
    job_dir = tmp_path / "storage" / "on-worker"
    checkpoints = str(job_dir / "checkpoints")
    hold = tmp_path / "hold"  # (see below)

    server.wait_healthy()
    with (
        temporary_settings({PREFECT_API_URL: server.api_url}),
        get_client(sync_client=True) as client,
    ):
        deployment_id, worker = trainer_on_process_worker(
            server.api_url,
            "cpu",
            "trainer-on-worker",
            params,
            tmp_path / "worker-home",
            tmp_path / "worker.log",
            query_seconds="1",
            paths=[str(HERE)],
            PREFECT_JAX_TEST_HOLD=str(hold),
        )
        processes.append(worker)
        run = client.create_flow_run_from_deployment(
            deployment_id, idempotency_key=str(uuid.uuid4())
        )  # one run, however often the client sends it (see start_deployment_run)

        # SIGKILL the run's process (the worker's child) once a checkpoint is committed.
        until(
            f"committed step >= {KILL_FROM}",
            lambda: (committed_steps(checkpoints) or [0])[-1] >= KILL_FROM,
            240,
            worker,
        )
        first = _lease(job_dir)
        assert first["pid"] in [
            p.pid for p in psutil.Process(worker.pid).children(recursive=True)
        ], first
        os.kill(first["pid"], signal.SIGKILL)
        until("the killed process gone", lambda: dead(first["pid"]), 30, worker)
        resume_from = committed_steps(checkpoints)[-1]
        assert resume_from < MAX_STEPS

        # The automation reruns it; once the rerun trains, the run is set
        # AwaitingRetry again (as the automation does on the worker's late second
        # report): the worker starts a second process.
        def rerun_training():
            lease = _lease(job_dir)
            trained_on = (committed_steps(checkpoints) or [0])[-1] > resume_from
            return (
                lease
                if lease and lease["pid"] != first["pid"] and not dead(lease["pid"]) and trained_on
                else None
            )

        rerun = until("a rerun that trains", rerun_training, 120, worker)
        # Its training held (`programs.Paced`) until the second process has started: on a slow
        # machine the rerun could otherwise finish first, and there would be none to wait for
        hold.touch()
        client.set_flow_run_state(run.id, AwaitingRetry(), force=True)
        until(
            "a second process of the run waiting for the first",
            lambda: "already trains job" in worker.tail(400_000),
            120,
            worker,
        )
        hold.unlink()

        # Every process of the run ends; the run ends Completed.
        until(
            "the job's last step",
            lambda: MAX_STEPS in committed_steps(checkpoints),
            240,
            worker,
            every=0.5,
        )
        until(
            "no flow-run process left",
            lambda: not psutil.Process(worker.pid).children(recursive=True),
            120,
            worker,
            every=0.5,
        )
        final = until(
            "a final state",
            lambda: (r := client.read_flow_run(run.id)).state.is_final() and r,
            60,
            worker,
            every=0.5,
        )
    log = worker.tail(2_000_000)
    assert final.state.is_completed(), f"{final.state}\n{log[-8000:]}"

    # One writer at a time: no checkpoint written twice, no failed save;
    # the rerun that waited said so.
    for sign in ("Directory not empty", "Save failed", "lost the lease", "Traceback"):
        assert sign not in log, f"{sign!r} in the worker's log:\n{log[-8000:]}"
    assert f"already trains job {job_dir} in process {rerun['pid']}" in log
    # The attempts follow one another: each began restoring (took the lease) after the one
    # before it wrote its last record (a process that waited starts its attempt's clock when its
    # wait ended).
    attempts = read_ledger(JobStorage(str(tmp_path / "storage"), "on-worker"))["attempts"]
    for earlier, later in zip(attempts, attempts[1:], strict=False):
        assert later["process_start"] + later["seconds"]["startup"] >= earlier["updated"] - 0.5, (
            attempts
        )
    assert _lease(job_dir) is None  # released by the last

    # The same end as the uninterrupted run, and every train metric in MLflow once.
    assert checkpoint_fingerprint(job_config(params), MAX_STEPS)[0] == expected
    mlflow = MlflowClient(mlflow_uri)
    (mlflow_run,) = mlflow.search_runs([mlflow.get_experiment_by_name("prefect-jax").experiment_id])
    assert mlflow_run.info.status == "FINISHED"
    logged = sorted(m.step for m in mlflow.get_metric_history(mlflow_run.info.run_id, "train/loss"))
    assert logged == list(range(LOG_EVERY, MAX_STEPS + 1, LOG_EVERY))
