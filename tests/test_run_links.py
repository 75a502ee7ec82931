"""Every flow run of a job, trainer, evaluator or export, carries the job's tags and one link to
its MLflow run, and the MLflow run lists every one of them; the link of a run whose MLflow run is
known up front goes out at once; an evaluator a late event starts after the job finished and
exported ends at once; one artifact per key per flow run."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient
from prefect import flow

from prefect_jax.flows import evaluate, export_flow, train
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
    key = f"{JOB}-mlflow-run"
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
    # The newest trainer's run is "the" flow run; the evaluator and the export do not re-point it.
    assert run.data.tags["prefect.flow_run_id"] == str(runs[4].id)
    # The trainer knew its MLflow run from the checkpoint: its link went out before MLflow
    # answered, as MLflow's route to a run by id.
    assert f"/#/runs/{run_id}?workflowType=machine_learning" in links[str(runs[0].id)][0].data


def test_a_flow_run_that_links_twice_keeps_one_link_and_one_goodput_artifact(tmp_path, mlflow_uri):
    from prefect.client.orchestration import get_client

    from prefect_jax.flows.hooks import _publish_goodput
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
        _publish_goodput(config, goodput)
        _publish_goodput(config, goodput, lead="Published again. ")
        publisher.flush()

    state = started_twice(return_state=True)
    assert state.is_completed(), state
    with get_client(sync_client=True) as client:
        flow_run_id = state.state_details.flow_run_id
        links = _artifacts(client, flow_run_id, f"{JOB}-mlflow-run")
        goodputs = _artifacts(client, flow_run_id, f"{JOB}-goodput")
    assert len(links) == 1, links
    assert len(goodputs) == 1 and goodputs[0].description.startswith("Published again."), goodputs
