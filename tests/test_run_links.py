"""Every flow run of a job, trainer, evaluator or export, carries the job's tags and one link to
its MLflow run, and the MLflow run lists every one of them; the link of a run whose MLflow run is
known up front goes out at once, and a job's first run makes its MLflow run and links it before
its first step; MLflow's "Prefect flow run" stays the newest run that trained (not a no-op run);
an evaluator a late event starts after the job finished and exported ends at once; one artifact
per key per flow run."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient
from prefect import flow

from prefect_jax.flows import evaluate, export_flow, train
from prefect_jax.tasks.publish import job_artifact_key
from prefect_jax.training.specs import (
    CheckpointSpec,
    EvalSpec,
    FinalExporter,
    JobConfig,
    LatestExporter,
    TrainSpec,
)

pytestmark = [pytest.mark.usefixtures("prefect_server"), pytest.mark.slow]

JOB = "linked"


def _params(tmp_path, mlflow_uri) -> dict:
    return {
        "program": "prefect_jax.examples.digits:tiny",
        "job": JOB,
        "storage": str(tmp_path / "storage"),
        "train_spec": TrainSpec(max_steps=20, log_every_steps=10),
        "checkpoint_spec": CheckpointSpec(every_steps=20),
        "eval_spec": EvalSpec(exporters=[LatestExporter(), FinalExporter()]),
        "mlflow_tracking_uri": mlflow_uri,
    }


def _flow_run(client, state):
    return client.read_flow_run(state.state_details.flow_run_id)


def _artifacts(client, flow_run_id, key: str) -> list:
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    return client.read_artifacts(
        artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[key]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
        )
    )


def test_trainer_evaluator_and_export_runs_are_linked_both_ways_and_a_late_evaluator_does_nothing(
    tmp_path, mlflow_uri
):
    from prefect.client.orchestration import get_client

    from prefect_jax.training.trainer import Trainer

    params = _params(tmp_path, mlflow_uri)
    # Trained outside Prefect, MLflow's answer awaited first: the checkpoint names the run.
    config = JobConfig(
        program=params["program"],
        job=JOB,
        storage=params["storage"],
        train=params["train_spec"],
        checkpoint=params["checkpoint_spec"],
        mlflow_tracking_uri=mlflow_uri,
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    run_id = trainer.job.tracker.run_id
    while trainer.step < config.train.max_steps:  # the trainer role: no evaluation here
        trainer.train_until_checkpoint()
    trainer.job.checkpoints.wait()
    trainer.finish()
    trainer.close()

    trained = train(**params, return_state=True)  # a no-op: the job is done
    evaluated = evaluate(**params, once=True, return_state=True)
    exported = export_flow(**params, return_state=True)
    late = evaluate(**params, once=True, return_state=True)  # a late checkpoint event's run
    again = train(**params, return_state=True)
    states = [trained, evaluated, exported, late, again]
    assert all(s.is_completed() for s in states), states
    assert evaluated.result()["evaluated"] == [20]
    summary = late.result()
    assert summary["evaluated"] == [] and "; nothing to do:" in summary["stopped"], summary

    run = MlflowClient(mlflow_uri).get_run(run_id)
    key = job_artifact_key(JOB, params["storage"], "mlflow-run")
    with get_client(sync_client=True) as client:
        runs = [_flow_run(client, s) for s in states]
        links = {str(r.id): _artifacts(client, r.id, key) for r in runs}
    for flow_run in runs[:3] + runs[4:]:  # every run that wrote to the MLflow run
        assert {"prefect-jax", f"job:{JOB}", f"mlflow-run:{run_id}"} <= set(flow_run.tags), (
            flow_run.name,
            flow_run.tags,
        )
        assert len(links[str(flow_run.id)]) == 1, (flow_run.name, links[str(flow_run.id)])
        assert run_id in links[str(flow_run.id)][0].data
        url = run.data.tags[f"prefect.flow_run.{flow_run.id}"]
        assert url.endswith(f"/runs/flow-run/{flow_run.id}"), url
    assert f"job:{JOB}" in runs[3].tags
    # "The" flow run is the newest that trained: here none did (the job was trained outside
    # Prefect), so neither the no-op trainers nor the evaluator and the export claim it.
    assert "prefect.flow_run_id" not in run.data.tags, run.data.tags
    # The trainer knew its MLflow run from the checkpoint: its link went out before MLflow
    # answered, as MLflow's route to a run by id, and was replaced in place by the run's route
    # in its experiment once MLflow answered (MLflow 3.17 opens the first in its GenAI view).
    experiment = run.info.experiment_id
    route = f"/#/experiments/{experiment}/runs/{run_id}?workflowType=machine_learning"
    assert route in links[str(runs[0].id)][0].data


def test_a_flow_run_that_links_twice_keeps_one_link_and_one_goodput_artifact(tmp_path, mlflow_uri):
    from prefect.client.orchestration import get_client

    from prefect_jax.flows.hooks import publish_goodput
    from prefect_jax.tasks import publisher, restore_or_init
    from prefect_jax.training.live import live_trainer

    config = JobConfig(
        program="prefect_jax.examples.digits:tiny",
        job=JOB,
        storage=str(tmp_path / "storage"),
        train=TrainSpec(max_steps=20),
        mlflow_tracking_uri=mlflow_uri,
    )

    @flow
    def started_twice():
        restore_or_init(config)
        restore_or_init(config)  # as a second start of the same flow run does
        goodput = live_trainer(config).goodput()
        publish_goodput(config, goodput)
        publish_goodput(config, goodput, lead="Published again. ")
        publisher.flush()

    state = started_twice(return_state=True)
    assert state.is_completed(), state
    with get_client(sync_client=True) as client:
        flow_run_id = state.state_details.flow_run_id
        links = _artifacts(client, flow_run_id, job_artifact_key(JOB, config.storage, "mlflow-run"))
        goodputs = _artifacts(client, flow_run_id, job_artifact_key(JOB, config.storage, "goodput"))
    assert len(links) == 1, links
    assert len(goodputs) == 1 and goodputs[0].description.startswith("Published again."), goodputs


def test_a_no_op_train_leaves_mlflow_naming_the_run_that_trained(tmp_path, mlflow_uri):
    params = _params(tmp_path, mlflow_uri)
    trained = train(**params, return_state=True)
    again = train(**params, return_state=True)  # a no-op: the job is done
    assert trained.is_completed() and again.is_completed(), (trained, again)
    assert again.result()["final_step"] == 20
    trained_id, again_id = (str(s.state_details.flow_run_id) for s in (trained, again))
    tags = MlflowClient(mlflow_uri).get_run(trained.result()["mlflow_run_id"]).data.tags
    assert tags["prefect.flow_run_id"] == trained_id, (tags, trained_id, again_id)
    assert tags["prefect.flow_run_url"].endswith(f"/runs/flow-run/{trained_id}")
    assert f"/runs/flow-run/{trained_id}" in tags["mlflow.note.content"]
    assert f"/runs/flow-run/{again_id}" not in tags["mlflow.note.content"]
    for run in (trained_id, again_id):  # both are listed
        assert tags[f"prefect.flow_run.{run}"].endswith(f"/runs/flow-run/{run}")


def test_a_link_made_before_mlflow_answers_says_so_and_is_updated_in_place(
    tmp_path, mlflow_uri, monkeypatch
):
    """A trainer's restore waits a bounded time for its first MLflow run; past it, the link
    artifact says the run is not started yet, and becomes the run's link once MLflow answers."""
    import threading

    from prefect.client.orchestration import get_client

    from prefect_jax.tasks import link_runs, publisher
    from prefect_jax.training.tracking import Tracker

    monkeypatch.setenv(
        "PREFECT_JAX_MLFLOW_IN_PROCESS", "1"
    )  # its thread here, for the test to hold
    config = JobConfig(
        program="prefect_jax.examples.digits:tiny",
        job=JOB,
        storage=str(tmp_path),
        train=TrainSpec(max_steps=10),
        mlflow_tracking_uri=mlflow_uri,
    )
    opened = threading.Event()
    seen = {}
    link_key = job_artifact_key(JOB, config.storage, "mlflow-run")

    @flow
    def job_flow():
        from prefect.runtime import flow_run

        tracker = Tracker(mlflow_uri, "prefect-jax", str(tmp_path / JOB))
        tracker._pool.submit(opened.wait, 60)  # MLflow's store takes long to open
        tracker.start({"p": "1"})
        link_runs(config, tracker, trains=False, wait_secs=1.0)
        # (1 s may not be enough for a slow server's four calls: it only warns then)
        assert publisher.flush(), "the link was not published"  # MLflow held: the pending one
        with get_client(sync_client=True) as client:
            seen["before"] = _artifacts(client, flow_run.id, link_key)
        opened.set()
        tracker.finish("FINISHED")
        publisher.flush()
        return str(flow_run.id), tracker.run_id

    flow_run_id, run_id = job_flow()
    (before,) = seen["before"]
    assert "not started yet" in before.data and run_id not in before.data, before.data
    with get_client(sync_client=True) as client:
        links = _artifacts(client, flow_run_id, link_key)
        tags = client.read_flow_run(flow_run_id).tags
    assert len(links) == 1 and links[0].id == before.id, links
    assert run_id in links[0].data and "not started yet" not in links[0].data, links[0].data
    assert f"mlflow-run:{run_id}" in tags, tags


@pytest.mark.timeout(420)
def test_a_first_run_killed_in_its_first_interval_is_linked_to_the_run_its_rerun_writes_into(
    tmp_path, prefect_server
):
    import json
    import signal

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from process_helpers import start_run, wait_until

    from prefect_jax.training.checkpoint_dirs import committed_steps

    mlflow_uri = f"sqlite:///{tmp_path}/mlflow.db"  # a new store: it opens in seconds, not at once
    storage, job = tmp_path / "storage", "first-killed"
    ckpt, lease_path = storage / job / "checkpoints", storage / job / "lease.json"
    args = [
        *("--program", "programs:big", "--job", job, "--storage", str(storage)),
        *("--max-steps", "400", "--checkpoint-every-steps", "200", "--exporters"),
        *("--mlflow-tracking-uri", mlflow_uri, "--json", "--no-progress"),
    ]

    def lease() -> dict | None:
        try:
            return json.loads(lease_path.read_text())
        except (OSError, ValueError):  # not there, or being written
            return None

    with get_client(sync_client=True) as client:

        def first_interval_running(flow_run_id) -> bool:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
            return any(r.name == "train 0 to 200" and r.state_type.value == "RUNNING" for r in runs)

        proc = start_run(args, prefect_server, tmp_path / "1.log")
        try:
            flow_run_id = wait_until(lease, 180, "the lease", proc)["flow_run_id"]
            wait_until(
                lambda: first_interval_running(flow_run_id), 240, "train 0 to 200", proc, poll=0.02
            )
        finally:
            proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
        assert not (committed_steps(str(ckpt)) if ckpt.exists() else []), "killed after a save"
        tags = client.read_flow_run(flow_run_id).tags
        links = _artifacts(client, flow_run_id, job_artifact_key(job, str(storage), "mlflow-run"))
    named = [t.split(":", 1)[1] for t in tags if t.startswith("mlflow-run:")]
    assert len(named) == 1 and {"prefect-jax", f"job:{job}"} <= set(tags), tags
    assert len(links) == 1 and named[0] in links[0].data, [a.data for a in links]

    proc = start_run(args, prefect_server, tmp_path / "2.log")
    assert proc.wait(timeout=300) == 0, (tmp_path / "2.log").read_text()[-4000:]
    summary = json.loads((tmp_path / "2.log").read_text().strip().splitlines()[-1])
    assert summary["final_step"] == 400 and summary["mlflow_run_id"] == named[0], summary
