"""Trainer, evaluator and export as separate flows on one job; events; early stopping; rerun
budget."""

import contextlib
import json
import logging
import os

import pytest
from process_helpers import job_events
from test_flow import _device_bytes

from prefect_jax.flows import evaluate, export_flow, train, train_and_evaluate
from prefect_jax.training.control import record_attempt
from prefect_jax.training.errors import NoProgressError
from prefect_jax.training.specs import (
    BestExporter,
    CheckpointSpec,
    EarlyStopping,
    EvalSpec,
    FinalExporter,
    LatestExporter,
    TrainSpec,
)
from prefect_jax.training.storage import JobStorage

pytestmark = pytest.mark.usefixtures("prefect_server")


def _params(tmp_path, mlflow_uri, job, max_steps=60, **eval_kw):
    return dict(
        program="prefect_jax.examples.digits:tiny",
        job=job,
        storage=str(tmp_path / "storage"),
        train_spec=TrainSpec(max_steps=max_steps, log_every_steps=10),
        checkpoint_spec=CheckpointSpec(every_steps=20, keep_last=None),
        eval_spec=EvalSpec(**eval_kw),
        mlflow_tracking_uri=mlflow_uri,
    )


@contextlib.contextmanager
def _flow_run_logs(level: int = logging.WARNING):
    """What flow runs log meanwhile at `level` or above (Prefect's run loggers do not propagate to
    caplog)."""
    said: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("prefect.flow_runs")
    was = logger.level  # (the tests' PREFECT_LOGGING_LEVEL is WARNING)
    logger.addHandler(handler)
    logger.setLevel(min(level, logger.getEffectiveLevel()))
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(was)


def test_trainer_then_evaluator_evaluate_every_checkpoint_once(
    tmp_path, mlflow_uri, prefect_server
):
    params = _params(tmp_path, mlflow_uri, "roles", exporters=[LatestExporter(), FinalExporter()])
    trained = train(**params)
    assert trained["final_step"] == 60 and trained["eval"] == {}
    js = JobStorage(params["storage"], "roles")
    assert not os.path.exists(js.eval_dir("eval"))  # the trainer evaluates nothing

    committed = job_events(
        prefect_server, "roles", params["storage"], "prefect-jax.checkpoint.committed", expect=3
    )
    assert sorted(e["payload"]["step"] for e in committed) == [20, 40, 60]

    from prefect_jax.training import live

    live.drop_all(close=False)  # the evaluator is another process: no live state
    before = _device_bytes()
    result = evaluate(**params, poll_secs=0.1)
    assert _device_bytes() - before < 1000  # its state freed as its flow run ends (test_flow)
    assert result["evaluated"] == [20, 40, 60]
    assert result["stopped"].startswith("evaluated the final step")
    assert result["exports"] == {"final": [60], "latest": [20, 40, 60]}
    again = evaluate(**params, poll_secs=0.1)
    assert again["evaluated"] == [] and again["stopped"].startswith("evaluated the final step")
    # The trainer's summary lists no exports: they are the evaluator's (the roles probe's trainer
    # printed whatever its evaluator had exported at that moment).
    assert train(**params)["exports"] == {}

    evals = job_events(
        prefect_server, "roles", params["storage"], "prefect-jax.eval.completed", expect=3
    )
    assert sorted(e["payload"]["step"] for e in evals) == [20, 40, 60]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    history = client.get_metric_history(trained["mlflow_run_id"], "eval/accuracy")
    assert [m.step for m in history] == [20, 40, 60]  # the evaluator joined the trainer's run
    assert client.get_run(trained["mlflow_run_id"]).info.status == "FINISHED"

    assert export_flow(**params, step=40) == {"latest": js.export_dir("latest", 40)}
    assert _device_bytes() - before < 1000


@pytest.mark.slow
def test_an_evaluator_prunes_the_exports_it_held_for_mlflow_and_an_export_flow_never(
    tmp_path, mlflow_uri, prefect_server
):
    """An evaluator exports faster than MLflow's worker registers, and keeps each export that is
    not a version yet past `keep`. It holds no lease, yet those it held are its to prune once
    registered (they stayed on disk, up to ten per exporter). An export flow's step, older than
    the exporter's `keep` newest, stays: pruned once registered, it would be gone as it ends."""
    from mlflow.tracking import MlflowClient

    params = _params(tmp_path, mlflow_uri, "held", max_steps=30, exporters=[LatestExporter(keep=1)])
    params["checkpoint_spec"] = CheckpointSpec(every_steps=5, keep_last=None)
    params["eval_spec"] = params["eval_spec"].model_copy(update={"registered_model": "held"})
    train(**params)
    from prefect_jax.training import live

    live.drop_all(close=False)  # the evaluator is another process: no live state
    result = evaluate(**params, poll_secs=0.1)
    assert result["evaluated"] == [5, 10, 15, 20, 25, 30]
    versions = MlflowClient(mlflow_uri).search_model_versions("name = 'held'")
    assert sorted(int(v.tags["prefect_jax.step"]) for v in versions) == [5, 10, 15, 20, 25, 30]
    js = JobStorage(params["storage"], "held")
    assert js.list_int_names(js.export_dir("latest")) == [30]  # back to keep=1
    live.drop_all(close=False)  # the export is another process too
    exported = export_flow(**params, step=10)
    assert exported == {"latest": js.export_dir("latest", 10)}
    assert js.list_int_names(js.export_dir("latest")) == [10, 30]


def test_the_evaluator_leaves_a_preemption_checkpoint_alone(tmp_path, mlflow_uri):
    """A step a SIGTERM checkpointed off the cadence (here 25) is resumed from, never evaluated:
    the evaluator evaluates 20, 40, 60, and does not spin on 25."""
    from prefect_jax.training.specs import JobConfig
    from prefect_jax.training.trainer import Trainer

    params = _params(tmp_path, mlflow_uri, "preempted")
    config = JobConfig(
        program=params["program"],
        job="preempted",
        storage=params["storage"],
        train=params["train_spec"],
        checkpoint=params["checkpoint_spec"],
        eval=params["eval_spec"],
        mlflow_tracking_uri=mlflow_uri,
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()  # 20
    interval = trainer.loop.run(trainer.state, 20, trainer.data_iter, 25, lambda: False)
    trainer.state, trainer.step = interval.state, 25
    trainer.intervals.save(preemption=True)  # what AttemptEnd.on_sigterm does mid-interval
    trainer.job.checkpoints.wait()
    trainer.close()
    rerun = Trainer(config)
    assert rerun.restore_or_init() == 25
    assert (
        rerun.evaluate_if_new().status.value == "PREEMPTION_CHECKPOINT"
    )  # the trainer's catch-up skips it too
    while rerun.step < 60:
        rerun.train_until_checkpoint()
    rerun.finish()
    rerun.close()

    from prefect_jax.training import live

    live.drop_all(close=False)
    result = evaluate(**params, poll_secs=0.1)
    assert result["evaluated"] == [20, 40, 60]
    assert JobStorage(params["storage"], "preempted").list_int_names(
        JobStorage(params["storage"], "preempted").eval_dir("eval")
    ) == [20, 40, 60]
    # Its export is refused saying why, not "evaluate it first" (it never is); so is a step
    # never committed (a walkthrough's finding: the same advice for both).
    with pytest.raises(ValueError, match="step 25 of job 'preempted' is a preemption's checkpoint"):
        export_flow(**params, step=25)
    with pytest.raises(ValueError, match=r"step 30 .* not committed \(.*committed: \[20, 25, 40"):
        export_flow(**params, step=30)


def test_evaluator_only_newest(tmp_path, mlflow_uri):
    params = _params(tmp_path, mlflow_uri, "newest")
    train(**params)
    result = evaluate(**params, every_checkpoint=False, poll_secs=0.1)
    assert result["evaluated"] == [60]


def test_evaluator_gives_up_waiting_for_a_first_checkpoint(tmp_path, mlflow_uri):
    state = evaluate(
        **_params(tmp_path, mlflow_uri, "nobody"),
        wait_for_first_checkpoint_secs=0.5,
        poll_secs=0.1,
        return_state=True,
    )
    assert state.is_failed()
    with pytest.raises(
        TimeoutError,
        match=r"no committed checkpoint of job 'nobody' .* after 0.5s \(storage .* has no job "
        r"'nobody'; no job there at all\): is the trainer running",
    ):
        state.result()
    assert not (tmp_path / "storage" / "nobody").exists()  # (`status` would list it)


def test_early_stopping_stops_both_roles(tmp_path, mlflow_uri):
    never_enough = EarlyStopping(
        metric="accuracy", mode="max", max_steps_without_improvement=20, min_delta=1.0
    )
    params = _params(tmp_path, mlflow_uri, "early", max_steps=100, early_stopping=never_enough)
    summary = train_and_evaluate(**params)
    assert summary["final_step"] == 40
    assert "early stopping: accuracy has not improved" in summary["stopped"]
    stop = json.load(open(tmp_path / "storage" / "early" / "stop.json"))
    assert stop["step"] == 40
    from prefect_jax.training.facade import job_status

    said = job_status("early", str(tmp_path / "storage"))["stop_requested"]  # (`status` shows it)
    assert (said["step"], said["by"]) == (40, "its evaluation 'eval'") and said["path"].endswith(
        "early/stop.json"
    )
    assert "early stopping: accuracy has not improved" in said["reason"]
    with _flow_run_logs() as said:
        again = train(**params)  # the trainer role honours the durable stop request
    assert again["final_step"] == 40 and again["stopped"] == stop["reason"]
    path = tmp_path / "storage" / "early" / "stop.json"
    assert any(  # what a rerun that trains nothing says: why, and how to go on
        m.startswith(
            "job early was asked to stop before this run (at step 40, by its evaluation 'eval': "
        )
        and m.endswith(f"nothing trained. Delete {path} to train it on from step 40")
        for m in said
    ), said


def test_early_stopping_leaves_out_evaluations_before_min_steps_as_tfs():
    """TF's `stop_if_no_decrease_hook(min_steps=...)`: evaluations before it neither stop the
    job nor count as the best (an early lucky loss would otherwise stop a warmup)."""
    from prefect_jax.training.control import EarlyStoppingHook
    from prefect_jax.training.evaluation import EvalResult, EvalStatus

    def records(*losses):
        return [
            EvalResult(status=EvalStatus.EVALUATED, step=10 * (i + 1), metrics={"loss": loss})
            for i, loss in enumerate(losses)
        ]

    spec = EarlyStopping(max_steps_without_improvement=20, min_steps=30)
    assert EarlyStopping(max_steps_without_improvement=20).min_steps == 0
    hook = EarlyStoppingHook.of(spec)
    # best at 10 (before min_steps): left out; from 30 the loss improves at 40, then not
    assert hook.should_stop(records(0.1, 0.9, 0.8, 0.7, 0.75)) is None
    assert "best 0.7 at step 40, last eval at step 60" in hook.should_stop(
        records(0.1, 0.9, 0.8, 0.7, 0.75, 0.72)
    )
    without = EarlyStoppingHook.of(spec.model_copy(update={"min_steps": 0}))
    assert "best 0.1 at step 10" in without.should_stop(records(0.1, 0.9, 0.8))
    with pytest.raises(ValueError, match="min_steps"):
        EarlyStopping(max_steps_without_improvement=20, min_steps=-1)


def test_rerun_budget_without_progress(tmp_path):
    js = JobStorage(str(tmp_path), "stuck")
    assert record_attempt(js, 100, 2) == 0
    assert record_attempt(js, 100, 2) == 1
    assert record_attempt(js, 100, 2) == 2
    with pytest.raises(
        NoProgressError,
        match="rerun 3 times without getting past step 100 .*max_reruns_without_progress=2.*"
        "checkpoint more often .*--checkpoint-every-secs.*attempts.json to reset",
    ):
        record_attempt(js, 100, 2)
    assert record_attempt(js, 120, 2) == 0  # progress resets the count
    assert record_attempt(js, 120, 2, "run-a", "host:1") == 1  # a rerun at 120
    # A task retry (the run that recorded it, in the same process): not a rerun.
    assert record_attempt(js, 120, 2, "run-a", "host:1") == 1
    assert record_attempt(js, 120, 2, "run-a", "host:2") == 2  # (the same run, another process)


def test_the_rerun_budgets_refusal_names_storage_without_its_secrets():
    """The refusal becomes the flow run's message and the MLflow run's stop reason: a URL's
    password is not in it, where the job and the file to delete still are."""
    js = JobStorage("memory://AKIAEXAMPLEKEY123:wJalrXUtnFEMI@bucket/jobs", "stuck")
    record_attempt(js, 100, 0)
    with pytest.raises(NoProgressError) as refused:
        record_attempt(js, 100, 0)
    said = str(refused.value)
    assert "wJalrXUtnFEMI" not in said and "EXAMPLEKEY" not in said, said
    assert "@bucket/jobs/stuck was rerun 1 times" in said
    assert "@bucket/jobs/stuck/attempts.json to reset" in said


def test_the_evaluator_and_the_exporter_follow_the_max_steps_their_trainer_recorded(
    tmp_path, mlflow_uri
):
    """TF's roles share one TrainSpec; here each step records its trainer's max_steps. An evaluator
    given a smaller one (it took step 20 for final, stopped, and the trainer's later steps went
    unevaluated), or an export given the command's default (step 40 was not final), follow it;
    the newest step's, where a rerun raised it (step 20 and 40 record 40, step 60 records 60)."""
    params = _params(tmp_path, mlflow_uri, "other-max", max_steps=40, exporters=[LatestExporter()])
    assert train(**params)["final_step"] == 40
    params["train_spec"] = TrainSpec(max_steps=60, log_every_steps=10)
    assert train(**params)["final_step"] == 60
    from prefect_jax.training import live

    live.drop_all(close=False)
    params["train_spec"] = TrainSpec(max_steps=20, log_every_steps=10)
    with _flow_run_logs(logging.INFO) as said:
        result = evaluate(**params, poll_secs=0.1, idle_timeout_secs=1)
    assert result["evaluated"] == [20, 40, 60], result
    assert result["stopped"] == "evaluated the final step (60 >= max_steps=60)", result
    assert (
        "job other-max's trainer trains to max_steps=60 (its step 60 records it): this evaluator "
        "follows it, not the max_steps=20 of its own train_spec (--max-steps)"
    ) in said, said
    live.drop_all(close=False)
    params.update(
        train_spec=TrainSpec(max_steps=1000), eval_spec=EvalSpec(exporters=[FinalExporter()])
    )
    js = JobStorage(params["storage"], "other-max")
    assert export_flow(**params, step=60) == {"final": js.export_dir("final", 60)}
    with _flow_run_logs() as said:  # (final when saved, not since the rerun)
        assert export_flow(**params, step=40) == {}
    assert (
        "exporter final wrote nothing: step 40 is not the job's final step (max_steps=60)" in said
    )


def test_an_export_flow_registers_what_it_exports_in_the_job_s_mlflow_run(tmp_path, mlflow_uri):
    """A job trained and evaluated without exporters, exported on demand afterwards (prefect.yaml's
    `export` deployment, the `export` command): its export is a version of the job's registered
    model, logged to the job's MLflow run. The export flow's trainer had joined no MLflow run: the
    export was written, its registration failed (run id None) with a warning, and the flow
    succeeded."""
    from mlflow.tracking import MlflowClient

    params = _params(tmp_path, mlflow_uri, "on-demand", max_steps=40, exporters=[])
    run_id = train_and_evaluate(**params)["mlflow_run_id"]
    from prefect_jax.training import live

    live.drop_all(close=False)
    params["eval_spec"] = EvalSpec(exporters=[LatestExporter()], registered_model="on-demand-m")
    with _flow_run_logs() as said:
        assert set(export_flow(**params)) == {"latest"}
    client = MlflowClient(mlflow_uri)
    (version,) = client.search_model_versions("name = 'on-demand-m'")
    assert version.tags["prefect_jax.step"] == "40" and version.run_id == run_id, version
    assert client.get_registered_model("on-demand-m").aliases == {"newest": version.version}
    assert not [s for s in said if "MLflow" in s], said
    # A step asked for that an exporter does not export: said why, not an empty answer alone.
    params["eval_spec"] = EvalSpec(exporters=[BestExporter()], registered_model="on-demand-m")
    assert set(export_flow(**params)) == {"best"}  # (40: nothing before it in best.json)
    with _flow_run_logs() as said:
        assert export_flow(**params, step=20) == {}
    (why,) = [s for s in said if s.startswith("exporter best wrote nothing: ")]
    assert "step 20 does not beat the best so far, step 40, by loss (min): " in why, why
