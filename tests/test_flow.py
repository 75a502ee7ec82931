"""The train_and_evaluate flow against a real Prefect server (prefect_test_harness)."""

import asyncio
import json
import logging
import threading
import time

import pytest
from mlflow.tracking import MlflowClient
from process_helpers import settled_task_runs

from prefect_jax.flows import train_and_evaluate
from prefect_jax.tasks.publish import job_artifact_key
from prefect_jax.training.names import JOB_TAG
from prefect_jax.training.specs import (
    CheckpointSpec,
    EvalSpec,
    FinalExporter,
    LatestExporter,
    TrainSpec,
)
from prefect_jax.training.storage import JobStorage

pytestmark = pytest.mark.usefixtures("prefect_server")


def _run(tmp_path, mlflow_uri, max_steps=40, job="flow-job", **kw):
    return train_and_evaluate(
        program="prefect_jax.examples.digits:tiny",
        job=job,
        storage=str(tmp_path / "storage"),
        train_spec=TrainSpec(max_steps=max_steps, log_every_steps=10),
        checkpoint_spec=CheckpointSpec(every_steps=20),
        eval_spec=EvalSpec(exporters=[LatestExporter(keep=2), FinalExporter()]),
        mlflow_tracking_uri=mlflow_uri,
        return_state=True,
        **kw,
    )


def _artifacts(api_url, flow_run_id):
    """Artifacts of a flow run and its task runs, read over the REST API."""
    import httpx

    body = {
        "artifacts": {"flow_run_id": {"any_": [str(flow_run_id)]}},
        "sort": "CREATED_DESC",
        "limit": 200,
    }
    response = httpx.post(f"{api_url}/artifacts/filter", json=body, timeout=30)
    response.raise_for_status()
    return response.json()


def _log_messages(api_url, flow_run_id) -> list[str]:
    """The log lines of a flow run and its task runs, read over the REST API. Prefect's log
    worker sends in batches (every 2 s) and the flow engine does not drain it when a flow run
    ends, so this drains it first: without it a read right after a run misses its last lines."""
    import httpx
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    body = {"logs": {"flow_run_id": {"any_": [str(flow_run_id)]}}, "limit": 200}
    response = httpx.post(f"{api_url}/logs/filter", json=body, timeout=30)
    response.raise_for_status()
    return [log["message"] for log in response.json()]


@pytest.fixture
def task_run_info_logs():
    """The task runs' INFO lines reach the API (the suite logs WARNING and up)."""
    logger = logging.getLogger("prefect.task_runs")
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(logging.NOTSET)


def test_flow_trains_evaluates_exports_and_a_rerun_repeats_nothing(
    tmp_path, mlflow_uri, prefect_server, task_run_info_logs
):
    state = _run(tmp_path, mlflow_uri)
    assert state.is_completed()
    summary = state.result()
    assert summary["final_step"] == 40
    assert summary["exports"] == {"final": [40], "latest": [20, 40]}
    assert set(summary["eval"]) == {"accuracy", "loss"}
    assert summary["checkpoint_dir"] == str(tmp_path / "storage" / "flow-job" / "checkpoints")
    assert len(summary["state_fingerprint"]) == 64

    runs = settled_task_runs(state.state_details.flow_run_id, "export 40")
    artifacts = _artifacts(prefect_server, state.state_details.flow_run_id)
    names = sorted(r.name for r in runs)
    assert names == sorted(
        [
            "restore or init flow-job",
            "train 0 to 20",
            "train 20 to 40",
            "evaluate 20",
            "evaluate 40",
            "export 20",
            "export 40",
        ]
    )
    assert all(r.state.is_completed() for r in runs)
    tables = [a for a in artifacts if a["type"] == "table"]
    key = lambda *parts: job_artifact_key("flow-job", str(tmp_path / "storage"), *parts)  # noqa: E731
    assert {a["key"] for a in tables} == {key("eval", "results"), key("goodput")}
    results = next(a for a in tables if a["key"] == key("eval", "results"))
    assert '"step": 40' in results["data"]  # newest version holds every evaluated step
    goodput = next(a for a in tables if a["key"] == key("goodput"))
    assert (
        "productive training (steps kept)" in goodput["data"]
        and summary["goodput"]["attempts"] == 1
    )
    progress = [a for a in artifacts if a["type"] == "progress"]
    assert [a["data"] for a in progress] == [100.0]

    # Rerun in a fresh process state: resumes at 40, trains nothing, evaluates nothing again.
    from prefect_jax.training import live

    live.drop_all()
    records = tmp_path / "storage" / "flow-job" / "evals" / "eval"
    before = sorted(p.name for p in records.iterdir())
    assert before == ["20.json", "40.json"]
    again_state = _run(tmp_path, mlflow_uri)
    again = again_state.result()
    assert again["state_fingerprint"] == summary["state_fingerprint"]
    assert again["mlflow_run_id"] == summary["mlflow_run_id"]
    assert sorted(p.name for p in records.iterdir()) == before
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("prefect-jax")
    job_dir = JobStorage(str(tmp_path / "storage"), "flow-job").job_dir
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job_dir}'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "eval/accuracy")] == [
        20,
        40,
    ]

    # Nor does it announce again the exports the first run wrote: no log line, no
    # prefect-jax.export.completed event (an automation on it would act twice).
    from process_helpers import job_events

    exported = [
        m
        for m in _log_messages(prefect_server, state.state_details.flow_run_id)
        if m.startswith("exporter ")
    ]
    assert len(exported) == 3, exported  # latest 20 and 40, final 40
    rerun_runs = settled_task_runs(again_state.state_details.flow_run_id, "export 40")
    assert "export 40" in [r.name for r in rerun_runs]  # the rerun's export task did run
    rerun_lines = _log_messages(prefect_server, again_state.state_details.flow_run_id)
    assert "eval of step 40: NO_NEW_CHECKPOINT (evaluated before: not again)" in rerun_lines, (
        rerun_lines
    )  # the read sees them
    assert not [m for m in rerun_lines if m.startswith("exporter ")], rerun_lines
    events = job_events(
        prefect_server, "flow-job", str(tmp_path / "storage"), "prefect-jax.export.", 3, timeout=5
    )
    assert sorted(e["payload"]["step"] for e in events) == [20, 40]


def test_an_evaluation_recorded_after_its_task_run_shows_on_that_task_run(
    tmp_path, mlflow_uri, prefect_server, monkeypatch
):
    """The live step's evaluation returns before its save commits, and the step is recorded later,
    from the next train task run's loop. Its results artifact and its eval event still belong to
    the evaluate task run (the Prefect UI shows them there), not to the train task run that
    happened to see the commit."""
    from datetime import datetime

    from conftest import hold_commit
    from process_helpers import job_events

    from prefect_jax.training.progress import add_progress_listener

    commit = hold_commit(monkeypatch, 100)
    # Every version of the table shown, in order: with the default, a publisher behind a slow
    # server (CI) drops step 100's version if step 200's is queued behind it (by design)
    monkeypatch.setenv("PREFECT_JAX_UI_REFRESH_SECS", "0")

    def at_log_step(step, max_steps, metrics):
        if step == 130:  # well into the next train task run: step 100 may commit now
            commit.set()

    remove = add_progress_listener(at_log_step)
    storage = str(tmp_path / "storage")
    try:
        state = train_and_evaluate(
            program="prefect_jax.examples.digits:tiny",
            job="late-record",
            storage=storage,
            train_spec=TrainSpec(max_steps=200, log_every_steps=10),
            checkpoint_spec=CheckpointSpec(every_steps=100),
            mlflow_tracking_uri=mlflow_uri,
            return_state=True,
        )
    finally:
        remove()
    assert state.is_completed() and commit.is_set()
    runs = {r.name: r for r in settled_task_runs(state.state_details.flow_run_id, "evaluate 200")}
    evaluate_100, evaluate_200 = runs["evaluate 100"], runs["evaluate 200"]
    results = [
        a
        for a in _artifacts(prefect_server, state.state_details.flow_run_id)
        if a["key"] == job_artifact_key("late-record", storage, "eval-results")
    ]
    by_steps = {tuple(row["step"] for row in json.loads(a["data"])): a for a in results}
    assert set(by_steps) == {(100,), (100, 200)}
    first = by_steps[(100,)]
    # Recorded after the evaluate task run had ended (the commit came
    # while step 100 -> 200 trained) ...
    assert datetime.fromisoformat(first["created"]) > evaluate_100.end_time
    # ... and still on it, as the final step's is on its own.
    assert first["task_run_id"] == str(evaluate_100.id)
    assert by_steps[(100, 200)]["task_run_id"] == str(evaluate_200.id)
    events = job_events(
        prefect_server, "late-record", storage, prefix="prefect-jax.eval.", expect=2
    )
    related = {
        e["payload"]["step"]: {r["prefect.resource.id"] for r in e["related"]} for e in events
    }
    assert f"prefect.task-run.{evaluate_100.id}" in related[100]
    assert f"prefect.task-run.{runs['train 100 to 200'].id}" not in related[100]
    assert f"prefect.task-run.{evaluate_200.id}" in related[200]


def test_a_deferred_evaluation_in_an_async_flow_still_publishes_its_results(
    job_config, prefect_server, monkeypatch
):
    """The tasks in a user's own `async` flow: there each sync task run opens its own Prefect
    client and closes it when it ends, so a record made later (the next train task's loop) must
    not publish through the evaluate task run's client; its artifact still links to that run."""
    from conftest import hold_commit
    from prefect import flow

    from prefect_jax.tasks import (
        evaluate_if_new,
        publisher,
        restore_or_init,
        train_until_checkpoint,
    )
    from prefect_jax.training.progress import add_progress_listener

    commit = hold_commit(monkeypatch, 100)
    monkeypatch.setenv("PREFECT_JAX_UI_REFRESH_SECS", "0")  # every version shown (as above)
    remove = add_progress_listener(lambda step, *_: step == 130 and commit.set())
    config = job_config(max_steps=200, every_steps=100, job="async-job")

    @flow
    async def my_job():
        step = restore_or_init(config)["step"]
        for _ in range(2):
            step = train_until_checkpoint(config, step)
            result = evaluate_if_new(config, step)
        publisher.flush()
        return result.step

    try:
        state = asyncio.run(my_job(return_state=True))
    finally:
        remove()
    assert state.is_completed() and commit.is_set()
    runs = {r.name: r for r in settled_task_runs(state.state_details.flow_run_id, "evaluate 200")}
    results = [
        a
        for a in _artifacts(prefect_server, state.state_details.flow_run_id)
        if a["key"] == job_artifact_key("async-job", config.storage, "eval-results")
    ]
    on = {a["task_run_id"]: [row["step"] for row in json.loads(a["data"])] for a in results}
    assert on == {str(runs["evaluate 100"].id): [100], str(runs["evaluate 200"].id): [100, 200]}


def _device_bytes() -> int:
    import gc

    import jax

    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def test_flow_extends_a_finished_job_when_max_steps_grows(tmp_path, mlflow_uri):
    before = _device_bytes()
    first = _run(tmp_path, mlflow_uri, max_steps=20).result()
    # A finished run's state leaves the device (its next run restores from storage): a notebook
    # or sweep that trains job after job in one process does not grow by a state each (tiny's is
    # about 50 kB; what is left is a few scalars).
    assert _device_bytes() - before < 1000
    longer = _run(tmp_path, mlflow_uri, max_steps=40).result()
    assert _device_bytes() - before < 1000
    assert first["final_step"] == 20 and longer["final_step"] == 40
    assert longer["mlflow_run_id"] == first["mlflow_run_id"]


def test_a_warm_start_evaluates_and_exports_only_the_new_jobs_own_steps(tmp_path, mlflow_uri):
    """A warm start's step is another job's model: as in TF, the new job's first evaluation is of
    its own first checkpoint, so the source's weights never become its export, registered version
    or best. A warm start to the job's own max_steps still evaluates (its final model)."""
    _run(tmp_path, mlflow_uri, max_steps=20).result()
    source = JobStorage(str(tmp_path / "storage"), "flow-job")
    path = f"{source.checkpoint_dir}/20"

    def warm(job, max_steps):
        return _run(tmp_path, mlflow_uri, max_steps=max_steps, job=job, checkpoint_path=path)

    assert warm("warm", 60).result()["final_step"] == 60
    target = JobStorage(str(tmp_path / "storage"), "warm")
    assert target.list_int_names(target.eval_dir("eval")) == [40, 60]
    assert target.list_int_names(target.export_dir("latest")) == [40, 60]
    assert warm("warm-final", 20).result()["final_step"] == 20
    final = JobStorage(str(tmp_path / "storage"), "warm-final")
    assert final.list_int_names(final.export_dir("final")) == [20]


def test_an_mlflow_tracking_block_named_by_the_environment_is_the_jobs_store(
    tmp_path, mlflow_uri, monkeypatch
):
    """``MLFLOW_TRACKING_URI=prefect-jax-mlflow-tracking/<block>`` (a work pool's environment) and
    no tracking URI among the flow's parameters (a deployment's run): the job records into the
    block's store and experiment, as it does given the block's name as its URI."""
    from prefect_jax.blocks import MlflowTracking

    MlflowTracking(tracking_uri=mlflow_uri, experiment="team-env").save("env-team", overwrite=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "prefect-jax-mlflow-tracking/env-team")
    summary = train_and_evaluate(
        program="prefect_jax.examples.digits:tiny",
        job="env-block",
        storage=str(tmp_path / "storage"),
        train_spec=TrainSpec(max_steps=20),
        checkpoint_spec=CheckpointSpec(every_steps=20),
    )
    assert summary["mlflow_tracking_uri"] == mlflow_uri
    client = MlflowClient(mlflow_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert client.get_experiment(run.info.experiment_id).name == "team-env"
    assert run.data.metrics["eval/accuracy"] == pytest.approx(summary["eval"]["accuracy"])


@pytest.mark.parametrize(
    ("given", "recorded"),
    [(None, "team-block"), ("prefect-jax", "prefect-jax"), ("mine", "mine")],
)
def test_a_given_experiment_wins_over_the_tracking_blocks_even_the_default_name(
    tmp_path, mlflow_uri, given, recorded
):
    """A flow run given `mlflow_experiment` records there, also when it is the default's name
    (``--mlflow-experiment prefect-jax``); given none, the tracking block's experiment."""
    from prefect_jax.blocks import MlflowTracking
    from prefect_jax.flows.config import checked_job_config

    MlflowTracking(tracking_uri=mlflow_uri, experiment="team-block").save(
        "exp-team", overwrite=True
    )
    parameters = dict(
        program="prefect_jax.examples.digits:tiny",
        job="experiment",
        storage=str(tmp_path / "storage"),
        train_spec=TrainSpec(max_steps=20),
        mlflow_tracking_uri="prefect-jax-mlflow-tracking/exp-team",
        mlflow_experiment=given,
    )
    config = checked_job_config(parameters)
    assert (config.mlflow_tracking_uri, config.mlflow_experiment) == (mlflow_uri, recorded)


def test_a_final_step_left_unevaluated_fails_the_run_and_the_rerun_evaluates_it(
    tmp_path, mlflow_uri, monkeypatch
):
    """TF's train_and_evaluate (local mode) raises when training ends without an evaluated final
    checkpoint ("There was no new checkpoint after the training"): the run must not end Completed
    with no final metrics. Here the final step's evaluation is lost (as when its record fails to
    land); the rerun evaluates and exports that step, and ends Completed."""
    from prefect_jax.flows import task_loop
    from prefect_jax.training.errors import FinalEvaluationMissingError

    evaluate_and_export = task_loop._evaluate_and_export
    monkeypatch.setattr(
        task_loop,
        "_evaluate_and_export",
        lambda config, step, last, on_new=None: (
            None if step == 40 else evaluate_and_export(config, step, last, on_new)
        ),
    )
    state = _run(tmp_path, mlflow_uri, max_steps=40)
    assert state.is_failed()
    with pytest.raises(FinalEvaluationMissingError, match="final step 40, but that step's evaluat"):
        state.result()
    run = MlflowClient(mlflow_uri).search_runs(
        [MlflowClient(mlflow_uri).get_experiment_by_name("prefect-jax").experiment_id],
        filter_string="tags.`prefect_jax.job` LIKE '%flow-job%'",
    )[0]
    assert run.info.status == "FAILED"

    monkeypatch.setattr(task_loop, "_evaluate_and_export", evaluate_and_export)
    rerun = _run(tmp_path, mlflow_uri, max_steps=40)
    assert rerun.is_completed()
    summary = rerun.result()
    assert summary["final_step"] == 40 and summary["eval"]
    assert summary["exports"]["final"] == [40]


def test_flow_with_a_bad_program_fails_and_names_it(tmp_path, mlflow_uri):
    state = train_and_evaluate(
        program="prefect_jax.examples.digits:missing",
        job="bad",
        storage=str(tmp_path / "storage"),
        train_spec=TrainSpec(max_steps=10),
        mlflow_tracking_uri=mlflow_uri,
        return_state=True,
    )
    assert state.is_failed()
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        state.result()


def test_the_flow_run_and_the_mlflow_run_name_each_other(tmp_path, mlflow_uri, prefect_server):
    """The flow run: a link artifact to the MLflow run, and job and MLflow run tags; the MLflow
    run: the flow run's URL (not a bare id)."""
    state = _run(tmp_path, mlflow_uri, max_steps=20)
    assert state.is_completed()
    summary, flow_run_id = state.result(), str(state.state_details.flow_run_id)
    run = MlflowClient(mlflow_uri).get_run(summary["mlflow_run_id"])
    links = [
        a
        for a in _artifacts(prefect_server, flow_run_id)
        if a["type"] == "markdown"
        and a["key"] == job_artifact_key("flow-job", str(tmp_path / "storage"), "mlflow-run")
    ]
    assert len(links) == 1, links
    expected = f"http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning"
    assert expected in links[0]["data"]
    # The run's description names the job's places and links the flow run too.
    note = run.data.tags["mlflow.note.content"]
    assert f"/runs/flow-run/{flow_run_id}" in note and "/checkpoints/<step>" in note, note
    assert run.data.tags["prefect.flow_run_url"].endswith(f"/runs/flow-run/{flow_run_id}")
    assert run.data.tags["prefect.flow_run_url"].startswith("http")

    async def tags():
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            return (await client.read_flow_run(flow_run_id)).tags

    assert {"prefect-jax", "job:flow-job", f"mlflow-run:{run.info.run_id}"} <= set(
        asyncio.run(tags())
    )
    # A rerun links the run before MLflow answers, by its id only (a route MLflow 3.17's UI sends
    # to its GenAI view: the probe's rerun link opened there); the run's route in its experiment
    # replaces it once MLflow answers.
    rerun = _run(tmp_path, mlflow_uri, max_steps=40)
    assert rerun.result()["mlflow_run_id"] == run.info.run_id
    links = [
        a["data"]
        for a in _artifacts(prefect_server, str(rerun.state_details.flow_run_id))
        if a["key"] == job_artifact_key("flow-job", str(tmp_path / "storage"), "mlflow-run")
    ]
    assert len(links) == 1 and expected in links[0], links


def test_progress_is_published_while_mlflow_is_still_starting(
    tmp_path, mlflow_uri, prefect_server, monkeypatch
):
    """The MLflow link waits for MLflow's run; the artifacts queued after it do not wait with it
    (they once did: a progress bar stood still in the UI until MLflow's store had opened)."""
    import threading

    from prefect import flow
    from prefect.runtime import flow_run

    from prefect_jax.tasks import link_runs, publisher
    from prefect_jax.training.specs import JobConfig
    from prefect_jax.training.tracking import Tracker

    monkeypatch.setenv(
        "PREFECT_JAX_MLFLOW_IN_PROCESS", "1"
    )  # its thread is here, where the test can hold it
    config = JobConfig(
        program="prefect_jax.examples.digits:tiny",
        job="slow-mlflow",
        storage=str(tmp_path),
        train=TrainSpec(max_steps=10),
    )
    opened, published = threading.Event(), threading.Event()

    @flow
    def job_flow() -> str:
        tracker = Tracker(mlflow_uri, "prefect-jax", "slow-mlflow")
        tracker._pool.submit(opened.wait, 60)  # MLflow's thread busy: the store takes long to open
        tracker.start({"p": "1"})
        link_runs(config, tracker)
        publisher.submit(published.set)  # queued after the link, as progress updates are
        assert published.wait(30), "a progress update waited for MLflow's run"
        assert not tracker._started.done()
        opened.set()
        tracker.finish("FINISHED")
        publisher.flush()
        return str(flow_run.id)

    flow_run_id = job_flow()
    links = [
        a
        for a in _artifacts(prefect_server, flow_run_id)
        if a["key"] == job_artifact_key("slow-mlflow", str(tmp_path), "mlflow-run")
    ]
    assert len(links) == 1, links

    async def tags():
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            return (await client.read_flow_run(flow_run_id)).tags

    run_ids = [
        r.info.run_id
        for r in MlflowClient(mlflow_uri).search_runs(
            [e.experiment_id for e in MlflowClient(mlflow_uri).search_experiments()],
            f"tags.`{JOB_TAG}` = 'slow-mlflow'",
        )
    ]
    assert len(run_ids) == 1
    assert {"prefect-jax", "job:slow-mlflow", f"mlflow-run:{run_ids[0]}"} <= set(
        asyncio.run(tags())
    )


@pytest.mark.parametrize("refresh_secs", ["3600", "0"])
def test_the_results_table_and_progress_refresh_at_most_every_ui_refresh_secs(
    tmp_path, mlflow_uri, prefect_server, monkeypatch, refresh_secs
):
    """The results table and the progress bar show only the latest state: with checkpoints
    seconds apart, a flow run makes one version of each every PREFECT_JAX_UI_REFRESH_SECS at most
    (the first at once; the newest at the end, on its own evaluate task run); 0 makes one for
    every evaluation and every checkpoint."""
    from prefect_jax.flows import progress_card
    from prefect_jax.tasks import publisher

    monkeypatch.setenv("PREFECT_JAX_UI_REFRESH_SECS", refresh_secs)
    monkeypatch.setattr(publisher, "_last_run", {})  # (as after any flow run's flush)
    progress_updates, seen = [], []  # (seen: what a failure shows of each update's moment)
    update, t0 = progress_card.update_progress, time.monotonic()

    def recording(shown, step, *a):
        progress_updates.append(step)
        held = sorted(map(str, publisher._held))
        seen.append((step, round(time.monotonic() - t0, 2), publisher._hurry, held))
        update(shown, step, *a)

    monkeypatch.setattr(progress_card, "update_progress", recording)
    state = train_and_evaluate(
        program="prefect_jax.examples.digits:tiny",
        job="refresh",
        storage=str(tmp_path / "storage"),
        train_spec=TrainSpec(max_steps=50, log_every_steps=10),
        checkpoint_spec=CheckpointSpec(every_steps=10),
        mlflow_tracking_uri=mlflow_uri,
        return_state=True,
    )
    assert state.is_completed()
    flow_run_id = state.state_details.flow_run_id
    runs = {r.name: str(r.id) for r in settled_task_runs(flow_run_id, "evaluate 50")}
    artifacts = _artifacts(prefect_server, flow_run_id)
    tables = sorted(
        ([row["step"] for row in json.loads(a["data"])], a["task_run_id"])
        for a in artifacts
        if a["key"] == job_artifact_key("refresh", str(tmp_path / "storage"), "eval-results")
    )
    steps = [10, 20, 30, 40, 50]
    versions = [(steps[: i + 1], runs[f"evaluate {steps[i]}"]) for i in range(len(steps))]
    if refresh_secs == "0":
        assert tables == versions
        assert progress_updates == steps, seen
    else:
        # The first call of each runs at once, unless the publisher's thread was behind (a slow
        # server: CI), with newer calls of its key queued behind it when its turn came: a stale
        # version is never shown, so the first shown is the newest queued once the thread caught
        # up (step 40 on CI once; none but the last when it was behind for the whole run; made
        # so by slowing its first call). The newest at the end, at the flush.
        assert tables[-1] == versions[-1]
        assert len(tables) <= 2 and all(t in versions[:-1] for t in tables[:-1]), tables
        assert progress_updates[-1] == 50 and len(progress_updates) <= 2, (
            seen,
            dict(publisher._last_run),
        )  # (once, in a full run: [10, 40, 50], not seen alone; what ran when, if it comes again)
    assert [a["data"] for a in artifacts if a["type"] == "progress"] == [100.0]


def test_a_held_refresh_runs_once_its_time_is_up_and_never_ahead_of_calls_before_it(monkeypatch):
    """The publisher's `refresh`: the first call of a key runs at once, later ones within
    PREFECT_JAX_UI_REFRESH_SECS are replaced by the newest, which runs when the time is up
    without a flush; a refresh never runs before a call submitted ahead of it; a held call that
    fails is logged and the publisher goes on; after a flush a key's next call runs at once."""
    import time

    from prefect_jax.tasks.publish import _Publisher

    monkeypatch.setenv("PREFECT_JAX_UI_REFRESH_SECS", "2")
    publisher, ran, gate = _Publisher(), [], threading.Event()
    publisher.submit(lambda: gate.wait(30) and ran.append("first"))
    publisher.refresh("k", lambda: ran.append(("k", 1, time.monotonic())))
    publisher.refresh("other", lambda: ran.append("other"))
    time.sleep(0.2)
    assert ran == []  # all behind the first call
    gate.set()
    deadline = time.monotonic() + 10
    while len(ran) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran[0] == "first" and ran[2] == "other" and ran[1][:2] == ("k", 1)
    first_ran = publisher._last_run["k"]  # (when the publisher timed it, before the call ran)
    for i in (2, 3, 4):
        publisher.refresh("k", lambda i=i: ran.append(("k", i, time.monotonic())))
    deadline = time.monotonic() + 10
    while len(ran) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert [r[:2] for r in ran[3:]] == [("k", 4)]  # 2 and 3 replaced, 4 ran with no flush
    assert ran[3][2] >= first_ran + 2
    publisher.refresh("k", lambda: 1 / 0)  # held (k ran just now), then fails at the flush: logged
    publisher.refresh(
        "other", lambda: ran.append("other again")
    )  # ("other" ran over 2 s ago: at once)
    assert publisher.flush(5) and len(ran) == 5 and ran[4] == "other again"
    publisher.refresh("k", lambda: ran.append("after the flush"))
    assert publisher.flush(5) and ran[5] == "after the flush"


def test_a_flush_never_runs_a_refresh_that_a_newer_one_in_the_queue_replaces(monkeypatch):
    """A flush that starts while the publisher's thread is still busy with an earlier call runs the
    held calls at once; a refresh whose key has a newer call still in the queue behind it is
    stale and does not run: only the newest shows (the progress card once showed a step between
    the first and the last when the end's flush caught the thread behind)."""
    from prefect_jax.tasks.publish import _Publisher

    monkeypatch.setenv("PREFECT_JAX_UI_REFRESH_SECS", "3600")
    publisher, ran, gate = _Publisher(), [], threading.Event()
    publisher.refresh("k", lambda: ran.append(10))  # the first of its key: at once
    deadline = time.monotonic() + 10
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    publisher.submit(lambda: gate.wait(30))  # the thread, busy (an artifact's slow round trip)
    for step in (20, 30, 40, 50):
        publisher.refresh("k", lambda step=step: ran.append(step))
    flushed: list[bool] = []
    flushing = threading.Thread(target=lambda: flushed.append(publisher.flush(30)))
    flushing.start()
    time.sleep(0.2)  # (the flush is under way: held calls are due at once)
    gate.set()
    flushing.join(35)
    assert flushed == [True] and ran == [10, 50]
    publisher.refresh("k", lambda: ran.append(60))  # after a flush: at once, as before
    assert publisher.flush(5) and ran == [10, 50, 60]


def test_a_flow_run_leaves_the_collector_alone_in_any_process(tmp_path, mlflow_uri, monkeypatch):
    """A flow never touches Python's garbage collector of the process it runs in: not in one
    called from a user's process (pytest's here), nor in one Prefect started for the flow run
    (here: its argv made the engine's). Only the `prefect-jax` command's own process tunes it
    (`prefect_jax.cli.startup`)."""
    import gc
    import sys

    from prefect_jax.training.trainer import Trainer

    seen: list[bool] = []  # whether the collector was on as each trainer was made
    made = Trainer.__init__

    def watched(self, *a, **kw):
        seen.append(gc.isenabled())
        return made(self, *a, **kw)

    monkeypatch.setattr(Trainer, "__init__", watched)
    frozen_before = gc.get_freeze_count()
    assert gc.isenabled()

    assert _run(tmp_path / "pytest", mlflow_uri).is_completed()
    assert seen and all(seen), "a flow called from pytest's process turned the collector off"
    assert gc.get_freeze_count() <= frozen_before

    seen.clear()
    monkeypatch.setattr(sys, "argv", [sys.argv[0].rsplit("/", 1)[0] + "/prefect/engine.py"])
    assert _run(tmp_path / "engine", mlflow_uri).is_completed()
    assert seen and all(seen), "a flow run in a process Prefect started turned the collector off"
    assert gc.isenabled() and gc.get_freeze_count() <= frozen_before


def test_a_run_logs_what_it_trains_on_and_its_progress_between_checkpoints(
    tmp_path, mlflow_uri, prefect_server, task_run_info_logs, monkeypatch
):
    """TF logged the loss and steps/s every `log_step_count_steps`; a job whose checkpoints are
    minutes apart said nothing between them where no progress bar is drawn (a worker, a CI log).
    Each interval's task run now logs a log point's means and throughput at most every
    PROGRESS_LINE_SECS (0 here: every log point), to the run's log in Prefect's API."""
    from prefect_jax.tasks import train as train_task

    monkeypatch.setattr(train_task, "PROGRESS_LINE_SECS", 0.0)
    state = _run(tmp_path, mlflow_uri, job="lines")
    assert state.is_completed()
    lines = _log_messages(prefect_server, state.state_details.flow_run_id)
    # What it trains on, said as it starts (a resume on another device count gets another mesh)
    assert [m for m in lines if m.startswith("job lines at step 0 (initialised); training on ")]
    for step in (10, 30):  # (log points inside the intervals 0-20 and 20-40)
        (line,) = [m for m in lines if m.startswith(f"step {step} of 40: ")]
        assert "loss=" in line and "steps_per_sec=" in line, line
    assert not [m for m in lines if m.startswith(("step 20 of 40: ", "step 40 of 40: "))], lines


def test_a_tasks_progress_lines_hear_its_own_job_not_another_on_the_same_trainer_thread():
    """Two jobs' train tasks in one process (a threaded task runner) wait on one trainer thread,
    each in its own progress scope: each hears its own job's training only (a process-wide
    listener logged each job's lines in both runs' logs)."""
    import threading

    from prefect_jax.training import trainer_thread
    from prefect_jax.training.progress import listening, notify_progress, progress_heard_here

    heard: dict[str, list[str]] = {"a": [], "b": []}
    both_listening = threading.Barrier(2, timeout=30)

    def train(job: str) -> bool:  # what a trainer's loop does at a log point, on that thread
        notify_progress(10, 40, {"job": job})
        return listening()

    def task(job: str) -> None:
        with progress_heard_here(lambda step, last, metrics: heard[job].append(metrics["job"])):
            both_listening.wait()  # (the other task listens while this one's training runs)
            call = trainer_thread.submit(train, job)
            assert trainer_thread.wait(call, 30)
            assert trainer_thread.outcome(call)

    tasks = [threading.Thread(target=task, args=(job,)) for job in heard]
    for t in tasks:
        t.start()
    for t in tasks:
        t.join(60)
    assert heard == {"a": ["a"], "b": ["b"]}
    assert not listening()  # (this test's context never listened)


def test_progress_lines_come_at_most_every_so_many_seconds():
    from prefect_jax.tasks.train import progress_lines

    now, said = [0.0], []
    heard = progress_lines(lambda *a: said.append(a[0] % a[1:]), 30.0, clock=lambda: now[0])
    for t, step in ((10, 50), (31, 100), (45, 150), (62, 200), (100, 250)):
        now[0] = t
        heard(step, 1000, {"loss": 2.0, "steps_per_sec": 5.0})
    assert said == [
        "step 100 of 1000: loss=2, steps_per_sec=5",
        "step 200 of 1000: loss=2, steps_per_sec=5",
        "step 250 of 1000: loss=2, steps_per_sec=5",
    ]
    heard(300, None, {"loss": 1.5})  # (a job without max_steps; 100 s is not 30 after 100 s)
    now[0] = 130
    heard(300, None, {"loss": 1.5})
    assert said[-1] == "step 300: loss=1.5"
    ending = progress_lines(lambda *a: said.append(a[0] % a[1:]), 0.0, until=400)
    ending(400, 1000, {"loss": 1.0})  # (the interval's end: its task's own line says it)
    assert said[-1] == "step 300: loss=1.5"
