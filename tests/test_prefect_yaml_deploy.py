"""The README's deployment path against a real `prefect server`, with the locked dependencies:
``prefect deploy --all`` from the repository's prefect.yaml, the scheduler making runs of the
nightly schedule, and a process worker running a scheduled run to completion (a schedule added
to the nightly deployment with small parameters, due now).

This is what the pins of fastapi (<0.151: ``prefect deploy`` got a 422 from
``/work_pools/<pool>/workers/filter``) and SQLAlchemy (<2.1: the scheduler failed every loop with
"Can't evaluate bulk DML statement", so schedules got no runs) are for.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from datetime import UTC
from pathlib import Path

import pytest
from deployment_helpers import ROOT, PrefectServerProcess, _base_env, _GroupProcess

from prefect_jax.training.checkpoint_dirs import committed_steps

pytestmark = pytest.mark.slow


def _prefect(
    api_url: str, home: Path, *args: str, timeout: float = 180
) -> subprocess.CompletedProcess:
    env = _base_env(PREFECT_HOME=str(home), PREFECT_API_URL=api_url)
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_prefect_deploy_all_schedules_and_a_process_worker(tmp_path, mlflow_uri):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    home = tmp_path / "home"
    server = PrefectServerProcess(
        tmp_path / "server", PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2"
    )
    worker = None
    try:
        server.wait_healthy()
        api = server.api_url
        for pool in (
            ["cpu", "--type", "process"],
            [
                "gpu",
                "--type",
                "kubernetes",
                "--base-job-template",
                "prefect_jax/deployments/kubernetes-gpu.json",
            ],
        ):
            created = _prefect(api, home, "work-pool", "create", *pool)
            assert created.returncode == 0, created.stdout + created.stderr
        deployed = _prefect(api, home, "--no-prompt", "deploy", "--all")
        assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]

        params = {
            "program": "prefect_jax.examples.digits:tiny",
            "job": "nightly-test",
            "storage": str(tmp_path / "storage"),
            "train_spec": {"max_steps": 40, "log_every_steps": 10},
            "checkpoint_spec": {"every_steps": 20},
            "mlflow_tracking_uri": mlflow_uri,
        }

        async def check_and_schedule():
            async with get_client() as client:
                names = [
                    "train_and_evaluate/digits-nightly",
                    "train/digits-trainer-cpu",
                    "train/digits-trainer",
                    "evaluate/digits-evaluator",
                    "export/digits-export",
                ]
                deployments = {n: await client.read_deployment_by_name(n) for n in names}
                nightly = deployments["train_and_evaluate/digits-nightly"]
                assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
                # A night's run that finds the last one training is Cancelled, not Failed.
                assert nightly.global_concurrency_limit.limit == 1
                assert nightly.concurrency_options.collision_strategy == "CANCEL_NEW"
                # The scheduler service makes the upcoming runs of the nightly schedule.
                by_nightly = FlowRunFilter(deployment_id={"any_": [nightly.id]})
                deadline = time.monotonic() + 60
                while not (scheduled := await client.read_flow_runs(flow_run_filter=by_nightly)):
                    assert time.monotonic() < deadline, (
                        "the scheduler made no run of the nightly schedule:\n" + server.tail()
                    )
                    await asyncio.sleep(1)
                assert all(r.state.is_scheduled() for r in scheduled)
                # Now keep them from running here: pause the schedule, drop its runs.
                for schedule in nightly.schedules:
                    await client.update_deployment_schedule(nightly.id, schedule.id, active=False)
                for run in await client.read_flow_runs(flow_run_filter=by_nightly):
                    await client.delete_flow_run(run.id)
                # A schedule of its own, due now, with a small job: the scheduler makes its run.
                from datetime import datetime, timedelta

                from prefect.client.schemas.actions import DeploymentScheduleCreate
                from prefect.client.schemas.schedules import IntervalSchedule

                # (due in 20 s: a scheduler that comes to it late, on a loaded server, still makes
                # this run, not tomorrow's, which the worker would not take)
                due_now = IntervalSchedule(
                    interval=timedelta(days=1),
                    anchor_date=datetime.now(UTC) + timedelta(seconds=20),
                )
                await client.create_deployment_schedules(
                    nightly.id,
                    [
                        DeploymentScheduleCreate(
                            schedule=due_now, active=True, parameters=params, max_scheduled_runs=1
                        )
                    ],
                )
                deadline = time.monotonic() + 60
                while not (made := await client.read_flow_runs(flow_run_filter=by_nightly)):
                    assert time.monotonic() < deadline, (
                        "the scheduler made no run of the test schedule:\n" + server.tail()
                    )
                    await asyncio.sleep(1)
                # (the scheduler makes a few at once, today's and the next days')
                first = min(made, key=lambda r: r.expected_start_time)
                assert first.parameters["job"] == "nightly-test"
                due_in = first.expected_start_time - datetime.now(UTC)
                assert due_in < timedelta(seconds=30), [r.expected_start_time for r in made]
                return first

        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: api}):
            run = asyncio.run(check_and_schedule())
            worker = _GroupProcess(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", "cpu", "--run-once"],
                _base_env(
                    PREFECT_HOME=str(home),
                    PREFECT_API_URL=api,
                    PREFECT_LOGGING_LEVEL="INFO",
                    PREFECT_WORKER_PREFETCH_SECONDS="60",  # (it waits for the run's time)
                ),
                tmp_path / "worker.log",
            )
            worker.proc.wait(timeout=300)

            async def runs_of_the_schedule():
                async with get_client() as client:
                    runs = await client.read_flow_runs(
                        flow_run_filter=FlowRunFilter(deployment_id={"any_": [run.deployment_id]})
                    )
                    return [r for r in runs if r.parameters.get("job") == "nightly-test"]

            runs = asyncio.run(runs_of_the_schedule())
        completed = [r for r in runs if r.state.is_completed()]
        assert len(completed) == 1, f"{[(r.name, r.state) for r in runs]}\n{worker.tail()}"
        assert completed[0].auto_scheduled, "the worker ran a run the scheduler made"
        assert committed_steps(str(tmp_path / "storage" / "nightly-test" / "checkpoints"))[-1] == 40
    finally:
        if worker is not None:
            worker.stop()
        server.stop()
