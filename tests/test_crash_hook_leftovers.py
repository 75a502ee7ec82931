"""A SIGKILLed flow-run process of a served deployment: Prefect's runner marks the flow run
Crashed and runs its crash hook, which marks the task run the dead process left Running Crashed
too, before anyone retries the run (the run's page tells the truth at once)."""

from __future__ import annotations

import os
import signal

import pytest
from deployment_helpers import (
    DEPLOYMENT,
    ServeProcess,
    dead,
    logs,
    start_deployment_run,
    wait_for_deployments,
)
from process_helpers import task_runs, wait_until
from test_sigkill_leftovers import (
    UNFINISHED,
    _kill_mid_interval,
    _lease,
    served_params,
)

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_a_sigkilled_flow_run_process_leaves_no_task_run_running(
    tmp_path, prefect_server, processes
):
    from prefect.client.orchestration import get_client

    storage, job = tmp_path / "storage", "crash-hook"
    params = served_params(tmp_path, storage, job)
    name = f"train_and_evaluate/{DEPLOYMENT}"
    with get_client(sync_client=True) as client:
        serve = ServeProcess(prefect_server, tmp_path / "serve-home", tmp_path / "serve.log")
        processes.append(serve)
        wait_for_deployments(client, serve, [name])
        flow_run = start_deployment_run(name, params)
        interval = _kill_mid_interval(
            client, flow_run.id, storage / job / "checkpoints", serve.alive
        )
        # The flow-run process only (the trainer, holding the lease): serve lives on and sees it
        # die.
        child = _lease(storage / job / "lease.json")["pid"]
        assert child in serve.children(), (child, serve.children())
        os.kill(child, signal.SIGKILL)
        wait_until(lambda: dead(child), 30, "the flow-run process to die")

        def settled():
            run = client.read_flow_run(flow_run.id)
            left = [r for r in task_runs(client, flow_run.id) if r.state_type.value in UNFINISHED]
            return run if run.state.is_crashed() and not left else None

        try:
            crashed = wait_until(settled, 90, "the crashed run's task runs to be marked", poll=0.5)
        except AssertionError:
            states = [(r.name, r.state_name) for r in task_runs(client, flow_run.id)]
            raise AssertionError(f"{states}\n{logs(serve)}") from None
        runs = {r.name: r for r in task_runs(client, flow_run.id)}
        assert serve.alive(), logs(serve)
    assert crashed.run_count == 1, crashed.run_count  # nobody retried it
    assert runs[interval].state_type.value == "CRASHED", runs[interval].state
    assert "crashed" in runs[interval].state.message, runs[interval].state.message
