"""What a SIGKILL leaves behind in the UIs is cleaned up by the run that takes the job over.

A SIGKILLed trainer runs no handler: Prefect still shows its flow run and its task run Running,
MLflow its run RUNNING. The next run that takes over the job's lease marks them:

- a local `prefect-jax run`, killed mid-interval and run again (a new flow run): the killed flow
  run and its unfinished task runs end Crashed, naming the pid and the flow run that took over;
  the MLflow run is KILLED, then RUNNING again while the rerun trains (the killed attempt is
  recorded in its tags and description), FINISHED at the end;
- a deployment run killed mid-interval and retried as the UI's Retry does it (the same flow
  run): the killed attempt's task runs end Crashed, and the flow run keeps one progress artifact.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import pytest
from deployment_helpers import (
    DEPLOYMENT,
    ServeProcess,
    dead,
    deployment_params,
    logs,
    start_deployment_run,
    wait_for_deployments,
)
from process_helpers import settled_task_runs, start_run, task_runs, wait_until

from prefect_jax.training.checkpoint_dirs import committed_steps

pytestmark = pytest.mark.slow

PROGRAM = "programs:big"  # paced steps (10 ms each): an interval lasts long enough to be killed in
MAX_STEPS, EVERY = 600, 200
UNFINISHED = ("SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING")


def _progress_artifacts(client, flow_run_id) -> list:
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterType,
    )

    return client.read_artifacts(
        artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
            type=ArtifactFilterType(any_=["progress"]),
        )
    )


def _kill_mid_interval(client, flow_run_id, ckpt: Path, alive, timeout: float = 240) -> str:
    """Once a step >= EVERY is committed and the server shows the next interval's task run
    Running, while the process has not begun saving that interval's end step, return its name
    (the caller SIGKILLs right away). (The server learns of task runs by events: on a loaded
    machine it can show one Running after the process has ended it.)"""

    def running_interval():
        if not (committed_steps(str(ckpt)) if ckpt.exists() else []):
            return None
        assert alive(), "the run ended before it could be killed"
        running = [
            r.name
            for r in task_runs(client, flow_run_id)
            if r.state_type.value == "RUNNING" and r.name.startswith("train ")
        ]
        saving = {p.name.split(".")[0] for p in ckpt.iterdir()}  # (`<step>` or Orbax's temporary)
        return next(
            (n for n in running if int(n.split()[1]) >= EVERY and n.split()[3] not in saving),
            None,
        )

    return wait_until(
        running_interval, timeout, "an interval after the first checkpoint to run", poll=0.05
    )


def _lease(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not there, or being written
        return None


def _leftovers(client, flow_run_id) -> list[str]:
    return [
        f"{r.name}: {r.state_name}"
        for r in task_runs(client, flow_run_id)
        if r.state_type.value in UNFINISHED
    ]


@pytest.mark.timeout(420)
def test_a_killed_local_run_is_marked_crashed_and_killed_by_the_rerun(
    tmp_path, prefect_server, mlflow_uri
):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client

    from prefect_jax.training.names import KILLED_TAG

    storage, job = tmp_path / "storage", "killed"
    ckpt, lease_path = storage / job / "checkpoints", storage / job / "lease.json"
    args = [
        "--program",
        PROGRAM,
        "--job",
        job,
        "--storage",
        str(storage),
        "--max-steps",
        str(MAX_STEPS),
        "--checkpoint-every-steps",
        str(EVERY),
        "--log-every-steps",
        "50",
        "--mlflow-tracking-uri",
        mlflow_uri,
        "--json",
        "--no-progress",
    ]
    mlflow = MlflowClient(mlflow_uri)
    with get_client(sync_client=True) as client:
        proc = start_run(args, prefect_server, tmp_path / "1.log")
        try:
            lease = wait_until(lambda: _lease(lease_path), 180, "the lease", proc)
            killed_id = lease["flow_run_id"]
            interval = _kill_mid_interval(client, killed_id, ckpt, lambda: proc.poll() is None)
        finally:
            proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
        resumed_from = committed_steps(str(ckpt))[-1]
        time.sleep(1.0)  # what the killed process had sent reaches the server
        assert client.read_flow_run(killed_id).state.is_running(), "nobody told the server"
        assert _leftovers(client, killed_id), f"{interval} should be left Running by the SIGKILL"

        # The rerun takes the job over: while it trains, the MLflow run is
        # RUNNING again, the kill recorded.
        proc = start_run(args, prefect_server, tmp_path / "2.log")
        try:
            wait_until(
                lambda: f"training from step {resumed_from} to" in (tmp_path / "2.log").read_text(),
                240,
                "the rerun to train",
                proc,
                poll=0.02,
            )
            rerun_id = _lease(lease_path)["flow_run_id"]

            def reopened() -> (
                bool
            ):  # the kill recorded, then RUNNING again (the killed attempt left it RUNNING too)
                (run,) = mlflow.search_runs(
                    [mlflow.get_experiment_by_name("prefect-jax").experiment_id],
                    filter_string=f"tags.`prefect_jax.job` = '{storage / job}'",
                )
                return run.data.tags.get(KILLED_TAG) == "1" and run.info.status == "RUNNING"

            # MLflow opens beside training (in its worker process): the run is reopened within
            # moments of the first steps, while the rerun still trains.
            wait_until(
                reopened,
                60,
                "the MLflow run to be RUNNING again while the rerun trains",
                proc,
                poll=0.05,
            )
            assert proc.wait(timeout=300) == 0, (tmp_path / "2.log").read_text()[-4000:]
        finally:
            proc.kill()
        out = (tmp_path / "2.log").read_text()
        summary = json.loads(out.strip().splitlines()[-1])

        killed = client.read_flow_run(killed_id)
        leftovers = _leftovers(client, killed_id)
        crashed = [r.name for r in task_runs(client, killed_id) if r.state_type.value == "CRASHED"]
        rerun = client.read_flow_run(rerun_id)
        artifacts = _progress_artifacts(client, killed_id)

    assert rerun_id != killed_id and rerun.state.is_completed(), rerun.state
    assert killed.state.is_crashed(), f"the killed flow run is {killed.state.name}\n{out[-4000:]}"
    assert f"pid {lease['pid']}" in killed.state.message and rerun_id in killed.state.message, (
        killed.state.message
    )
    assert not leftovers, leftovers
    assert interval in crashed, (interval, crashed)
    assert [a for a in artifacts if "killed" in (a.description or "")], [
        a.description for a in artifacts
    ]

    assert summary["final_step"] == MAX_STEPS
    run = mlflow.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags[KILLED_TAG] == "1", tags
    note = tags["prefect_jax.killed.1"]
    assert (
        f"pid {lease['pid']}" in note
        and killed_id in note
        and f"resumed from step {resumed_from}" in note
    ), note
    assert note in tags["mlflow.note.content"]


def served_params(tmp_path, storage, job: str) -> dict:
    """The parameters of a served train_and_evaluate run that is killed mid-interval."""
    mlflow_uri = f"sqlite:///{tmp_path}/mlflow.db"
    return deployment_params(PROGRAM, job, storage, mlflow_uri, MAX_STEPS, EVERY)


@pytest.mark.timeout(420)
def test_a_killed_deployment_run_retried_keeps_one_progress_artifact_and_no_running_task(
    tmp_path, prefect_server, processes
):
    from prefect.client.orchestration import get_client
    from prefect.states import AwaitingRetry, Crashed

    storage, job = tmp_path / "storage", "retried"
    params = served_params(tmp_path, storage, job)
    name = f"train_and_evaluate/{DEPLOYMENT}"
    with get_client(sync_client=True) as client:
        first = ServeProcess(prefect_server, tmp_path / "serve-home", tmp_path / "serve-1.log")
        processes.append(first)
        wait_for_deployments(client, first, [name])
        flow_run = start_deployment_run(name, params)
        interval = _kill_mid_interval(
            client, flow_run.id, storage / job / "checkpoints", first.alive
        )
        pids = first.children()
        first.kill_group(signal.SIGKILL)
        first.proc.wait(timeout=30)
        wait_until(lambda: all(dead(p) for p in pids), 30, "the flow-run process to die")
        time.sleep(1.0)  # what the killed process had sent reaches the server
        assert _leftovers(client, flow_run.id), f"{interval} should be left Running by the SIGKILL"
        assert len(_progress_artifacts(client, flow_run.id)) == 1

        # What the user does: the run crashed; they click Retry (the UI sends exactly this).
        client.set_flow_run_state(
            flow_run.id, Crashed(message="the machine was lost (SIGKILL)"), force=True
        )
        client.set_flow_run_state(
            flow_run.id, AwaitingRetry(message="Retry from the UI"), force=True
        )
        second = ServeProcess(prefect_server, tmp_path / "serve-home", tmp_path / "serve-2.log")
        processes.append(second)

        def final():
            run = client.read_flow_run(flow_run.id)
            assert second.alive(), logs(second)
            return run if run.state.is_final() else None

        done = wait_until(final, 300, "the retried run to end", poll=0.5)
        last = f"train {MAX_STEPS - EVERY} to {MAX_STEPS}"
        runs = settled_task_runs(flow_run.id, last, client=client)  # (a leftover never settles)
        artifacts = _progress_artifacts(client, flow_run.id)

    assert done.state.is_completed() and done.run_count == 2, f"{done.state}\n{logs(first, second)}"
    leftovers = [
        f"{r.name} (attempt {r.flow_run_run_count}): {r.state_name}"
        for r in runs
        if r.state_type.value in UNFINISHED
    ]
    assert not leftovers, leftovers
    killed = [r for r in runs if r.flow_run_run_count == 1 and r.name == interval]
    assert [r.state_type.value for r in killed] == ["CRASHED"], [
        (r.name, r.state_name) for r in runs
    ]
    assert len(artifacts) == 1, [(a.id, a.description) for a in artifacts]
    assert (
        artifacts[0].data == 100.0
        and f"step {MAX_STEPS} of {MAX_STEPS}" in artifacts[0].description
    )


@pytest.mark.timeout(300)
def test_a_run_killed_before_it_took_the_job_is_marked_crashed_by_the_next(
    tmp_path, prefect_server, mlflow_uri
):
    """Killed at flow start, before its lease: no takeover names it. The command tags its flow run
    with the job and its process from the start, and the next run proves that process gone."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    job, log1 = "killed-at-start", tmp_path / "1.log"
    args = [
        "--program",
        "prefect_jax.examples.digits:tiny",
        "--job",
        job,
        "--storage",
        str(tmp_path / "storage"),
        "--max-steps",
        "20",
        "--checkpoint-every-steps",
        "20",
        "--mlflow-tracking-uri",
        mlflow_uri,
        "--json",
        "--no-progress",
    ]
    proc = start_run(args, prefect_server, log1)
    try:
        wait_until(
            lambda: "Beginning flow run" in log1.read_text(), 180, "the flow run to begin", proc
        )
    finally:
        proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    with get_client(sync_client=True) as client:

        def runs():
            return client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"job:{job}"])), limit=10
            )

        (killed,) = wait_until(runs, 30, "the killed flow run, tagged with its job")
        assert f"process:{socket.gethostname()}:{proc.pid}" in killed.tags
        time.sleep(1.0)
        assert client.read_flow_run(killed.id).state.is_running(), "nobody told the server"

        proc = start_run(args, prefect_server, tmp_path / "2.log")
        assert proc.wait(timeout=240) == 0, (tmp_path / "2.log").read_text()[-4000:]
        states = {str(r.id): r.state for r in runs()}
    assert len(states) == 2 and sum(s.is_completed() for s in states.values()) == 1, states
    dead = states[str(killed.id)]
    killed_pid = next(t for t in killed.tags if t.startswith("process:")).rsplit(":", 1)[1]
    assert dead.is_crashed(), dead
    assert f"pid {killed_pid}" in dead.message and "its process is gone" in dead.message, (
        dead.message
    )
