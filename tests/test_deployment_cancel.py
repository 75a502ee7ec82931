"""A deployment run cancelled the way users cancel it: its state set to Cancelling, as the UI's
Cancel button does, while it trains under ``serve`` (Prefect's runner, which asks the flow-run
process over its control channel, then sends it SIGTERM).

The run must end Cancelled, not Crashed (a crashed run is what the rerun automation starts
again), with its step in flight checkpointed and the job's lease freed, and a rerun of the job
resumes from that step.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from deployment_helpers import (
    DEPLOYMENT,
    PrefectServerProcess,
    ServeProcess,
    deployment_params,
    logs,
    start_deployment_run,
    wait_for_deployments,
)

pytestmark = [pytest.mark.slow]

TINY = "prefect_jax.examples.digits:tiny"
MAX_STEPS = 100_000  # never reached: the run is cancelled
EVERY = 100


def test_a_deployment_run_cancelled_from_the_ui_ends_cancelled_with_its_step_kept(
    tmp_path, processes
):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    from prefect_jax.training.checkpoint_dirs import committed_steps

    server = PrefectServerProcess(tmp_path / "prefect-server")
    processes.append(server)
    server.wait_healthy()
    storage, job = tmp_path / "storage", "cancel"
    checkpoints = storage / job / "checkpoints"
    mlflow_uri = f"sqlite:///{tmp_path}/mlflow.db"
    params = deployment_params(TINY, job, storage, mlflow_uri, MAX_STEPS, EVERY)
    with (
        temporary_settings({PREFECT_API_URL: server.api_url}),
        get_client(sync_client=True) as client,
    ):
        serve = ServeProcess(server.api_url, tmp_path / "serve-home", tmp_path / "serve.log")
        processes.append(serve)
        wait_for_deployments(client, serve, [f"train_and_evaluate/{DEPLOYMENT}"])
        run = start_deployment_run(f"train_and_evaluate/{DEPLOYMENT}", params)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if checkpoints.exists() and committed_steps(str(checkpoints))[-1:] >= [2 * EVERY]:
                break
            assert not client.read_flow_run(run.id).state.is_final(), logs(serve)
            time.sleep(0.05)
        else:
            raise AssertionError(f"no step {2 * EVERY} committed\n{logs(serve)}")

        client.set_flow_run_state(run.id, Cancelling(message="Cancel from the UI"))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            state = client.read_flow_run(run.id).state
            if state.is_final():
                break
            time.sleep(0.2)
        assert state.name == "Cancelled", f"{state}\n{logs(serve)}"
        names = [s.name for s in client.read_flow_run_states(run.id)]
        assert "Crashed" not in names, (names, logs(serve))

    # The guard checkpointed the step in flight (off the cadence, unless the notice came between
    # intervals: then the save in flight committed), and freed the job's lease.
    log = Path(serve.log).read_text(errors="replace")
    steps = committed_steps(str(checkpoints))
    assert "SIGTERM at step" in log, log[-4000:]
    assert steps[-1] >= 2 * EVERY, steps
    lease = storage / job / "lease.json"
    assert not lease.exists(), (
        f"a cancelled run frees its lease; left: {lease.read_text(errors='replace')}\n{log[-6000:]}"
    )

    # A rerun of the job resumes from that step.
    from deployment_helpers import job_config

    from prefect_jax.training.trainer import Trainer

    trainer = Trainer(job_config(dict(params, train_spec={"max_steps": steps[-1] + EVERY})))
    try:
        assert trainer.restore_or_init() == steps[-1]
    finally:
        trainer.close()
