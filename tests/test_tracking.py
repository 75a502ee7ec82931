"""MLflow: one run per job across reruns, params, metrics at their steps, failures."""

import pytest
from conftest import train_and_close, train_to_end
from mlflow.tracking import MlflowClient

from prefect_jax.training.names import CHANGED_PARAM_TAG, JOB_TAG
from prefect_jax.training.specs import LatestExporter
from prefect_jax.training.tracking import Tracker, TrackingWarning
from prefect_jax.training.trainer import Trainer


def history_of(trainer, key: str):
    """The MLflow history of metric `key` in `trainer`'s run."""
    client = MlflowClient(trainer.config.mlflow_tracking_uri)
    return client.get_metric_history(trainer.job.tracker.run_id, key)


def test_one_run_per_job_with_params_and_metrics_at_their_steps(job_config):
    config = job_config(max_steps=40, every_steps=20)
    first = Trainer(config)
    first.restore_or_init()
    first.train_until_checkpoint()
    first.evaluate_if_new()
    first.job.checkpoints.wait()
    first.finish()
    first.close()

    rerun = Trainer(
        config.model_copy(update={"train": config.train.model_copy(update={"max_steps": 40})})
    )
    rerun.restore_or_init()
    assert rerun.job.tracker.run_id == first.job.tracker.run_id
    train_to_end(rerun)
    rerun.finish()

    client = MlflowClient(config.mlflow_tracking_uri)
    runs = client.search_runs(
        [client.get_experiment_by_name("prefect-jax").experiment_id],
        filter_string=f"tags.`{JOB_TAG}` = '{rerun.job.storage.job_dir}'",
    )
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "40"
    assert run.data.params["checkpoint.every_steps"] == "20"
    assert run.data.params["program_config.hidden"] == "[32, 32]"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [20, 40]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [
        10,
        20,
        30,
        40,
    ]


def test_a_rerun_that_changes_the_job_records_its_params_now_beside_the_first_ones(job_config):
    """MLflow refuses a param's second value: a rerun that trains further (or evaluates
    otherwise) records the value now as tag ``prefect_jax.param.<key>``, logs the params the run
    lacks, and drops the tag where a later rerun changes the value back."""
    config = job_config(max_steps=20, every_steps=20, job="changed")
    train_and_close(config)

    def rerun(max_steps, eval_steps, exporters=()):
        changed = config.model_copy(
            update={
                "train": config.train.model_copy(update={"max_steps": max_steps}),
                "eval": config.eval.model_copy(
                    update={"steps": eval_steps, "exporters": list(exporters)}
                ),
            }
        )
        trainer = train_and_close(changed)
        return MlflowClient(config.mlflow_tracking_uri).get_run(trainer.job.tracker.run_id).data

    data = rerun(40, 2, [LatestExporter()])
    assert (data.params["train.max_steps"], data.params["eval.steps"]) == ("20", "None")
    assert data.tags[f"{CHANGED_PARAM_TAG}train.max_steps"] == "40"
    assert data.tags[f"{CHANGED_PARAM_TAG}eval.steps"] == "2"
    assert data.params["eval.exporters.0.name"] == "latest"  # a key the run lacked

    data = rerun(60, None)  # eval.steps as it was: its tag goes; the exporter is gone
    assert data.tags[f"{CHANGED_PARAM_TAG}train.max_steps"] == "60"
    assert f"{CHANGED_PARAM_TAG}eval.steps" not in data.tags
    assert data.params["train.max_steps"] == "20"
    assert data.tags[f"{CHANGED_PARAM_TAG}eval.exporters.0.name"] == "<unset>"


def test_a_changed_param_too_long_for_a_tag_key_keeps_the_run_whole(mlflow_uri):
    """MLflow's tag keys are 250 characters at most: a changed param whose tag key would be longer
    gets no tag, and the rerun's run is the job's all the same (attached, RUNNING, its new
    params logged)."""
    long_key = "program_config." + "k" * 230
    first = Tracker(mlflow_uri, "prefect-jax", "long-key-job")
    first.start({long_key: "a", "short": "a"})
    first.finish()
    rerun = Tracker(mlflow_uri, "prefect-jax", "long-key-job")
    rerun.start({long_key: "b", "short": "b", "new": "1"})
    assert rerun.run_id == first.run_id
    run = MlflowClient(mlflow_uri).get_run(rerun.run_id)
    assert run.info.status == "RUNNING" and run.data.params["new"] == "1"
    assert run.data.tags[f"{CHANGED_PARAM_TAG}short"] == "b"
    assert not any(k.startswith(f"{CHANGED_PARAM_TAG}program_config") for k in run.data.tags)
    rerun.finish()


@pytest.mark.parametrize("where", ["worker process", "this process"])
def test_tracking_failure_warns_and_training_goes_on(job_config, tmp_path, monkeypatch, where):
    # MLflow's calls run in a worker process (its warnings come back here) or on a thread here.
    monkeypatch.setenv("PREFECT_JAX_MLFLOW_STRICT", "0")
    monkeypatch.setenv("PREFECT_JAX_MLFLOW_IN_PROCESS", "1" if where == "this process" else "0")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = job_config(max_steps=20).model_copy(
        update={"mlflow_tracking_uri": f"sqlite:///{blocker}/sub/mlflow.db"}
    )
    with pytest.warns(TrackingWarning, match=f"sqlite:///{blocker}/sub/mlflow.db"):
        trainer = Trainer(config)
        trainer.restore_or_init()
        trainer.job.tracker.flush()  # MLflow is opened in the background: wait for it
    trainer.train_until_checkpoint()
    assert trainer.step == 20
    trainer.finish()  # waits for the (failing) writes: warnings, no error


def test_tracking_failure_fails_in_strict_mode(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    tracker = Tracker(f"sqlite:///{blocker}/sub/mlflow.db", "e", "job")
    tracker.start({})  # returns at once: the failure comes out of the next call that waits
    with pytest.raises(NotADirectoryError):
        tracker.flush()


def held_tracker(tmp_path, monkeypatch, job: str):
    """A started Tracker whose MLflow thread (in this process, where the test can hold it) is held
    until the returned event is set: a tracking server that does not answer. Not strict."""
    import threading

    monkeypatch.setenv("PREFECT_JAX_MLFLOW_STRICT", "0")
    monkeypatch.setenv("PREFECT_JAX_MLFLOW_IN_PROCESS", "1")
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "e", job)
    release = threading.Event()
    tracker._pool.submit(release.wait, 60)
    tracker.start({"p": "1"})
    return tracker, release


def land_timed(tracker, caplog, limit: float) -> float:
    """`tracker.land(limit)`, its warnings captured; how long it took."""
    import time

    began = time.monotonic()
    with caplog.at_level("WARNING", logger="prefect_jax.tracking"):
        tracker.land(limit)
    return time.monotonic() - began


def test_land_waits_a_bounded_time_for_mlflow_unless_strict(tmp_path, monkeypatch, caplog):
    """The end of an evaluate or export flow run waits for its MLflow writes
    (`live.land_mlflow_writes`): at most its limit, then a warning, where a tracking server that
    hangs must not hold the run; in strict mode until they land."""
    import time

    tracker, release = held_tracker(tmp_path, monkeypatch, "land-job")
    assert land_timed(tracker, caplog, 0.5) < 10
    assert "write(s) still on their way after 0.5s, 0 failed; the run goes on" in caplog.text
    # A refused rerun's close (`Job.record_attempt`): bounded the same way, the refusal raised
    # next does not wait out MLflow's retries.
    caplog.clear()
    began = time.monotonic()
    with caplog.at_level("WARNING", logger="prefect_jax.tracking"):
        tracker.finish("FAILED", at_most=0.5)
    assert time.monotonic() - began < 10
    assert "write(s) still on their way after 0.5s" in caplog.text
    assert "the run may stay RUNNING, not FAILED, until a later run" in caplog.text
    release.set()
    monkeypatch.setenv("PREFECT_JAX_MLFLOW_STRICT", "1")
    tracker.land(0.0)  # strict: waits until it lands, whatever the limit
    assert tracker.run_id is not None and tracker._pending == []
    tracker.close()


def test_after_a_lost_process_the_end_waits_for_mlflow_a_few_seconds_only(
    tmp_path, monkeypatch, caplog
):
    """Once another process of the job went away, JAX's coordination service aborts this one about
    its heartbeat timeout later (the run would end Crashed, not Failed): the end of a run and the
    process's exit wait for MLflow `LOST_EXIT_WAIT_SECS` at most, not `EXIT_WAIT_SECS`."""
    import time

    from prefect_jax.training import cluster, mlflow_client

    monkeypatch.setattr(mlflow_client, "LOST_EXIT_WAIT_SECS", 0.3)
    tracker, release = held_tracker(tmp_path, monkeypatch, "lost-job")
    assert mlflow_client.exit_wait(30) == 30  # nothing lost: the full wait
    monkeypatch.setattr(cluster, "_lost", "process 1 of the job's 2 went away")
    assert land_timed(tracker, caplog, 30) < 10
    assert "write(s) still on their way after 0.3s" in caplog.text
    began = time.monotonic()
    with caplog.at_level("WARNING", logger="prefect_jax.tracking"):
        tracker.finish("FAILED")  # the train run's own end (`Job.finish`): bounded too
    assert time.monotonic() - began < 10
    assert "the run was not marked FAILED within 0.3s" in caplog.text
    release.set()
    monkeypatch.setattr(cluster, "_lost", None)
    tracker.land()
    tracker.close()


def test_exports_are_logged_as_models_beside_the_sqlite_store(job_config, mlflow_uri):
    from prefect_jax.training.specs import FinalExporter

    config = job_config(max_steps=20, exporters=[FinalExporter()]).model_copy(
        update={"mlflow_experiment": "artifacts-test"}
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    train_to_end(trainer)
    trainer.finish()
    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("artifacts-test")
    db_dir = mlflow_uri[len("sqlite:///") :].rsplit("/", 1)[0]
    assert experiment.artifact_location == f"file://{db_dir}/mlartifacts/artifacts-test"
    (model,) = client.search_logged_models(
        [experiment.experiment_id]
    )  # the export, as an MLflow Model
    assert model.artifact_location.startswith(f"file://{db_dir}/mlartifacts/artifacts-test/")
    names = {a.path for a in client.list_logged_model_artifacts(model.model_id)}
    assert {
        "MLmodel",
        "pyfunc_model.py",
        "artifacts",
        "input_example.json",
    } <= names and "__pycache__" not in names, names
    # the export, and its record (the pyfunc checks its inputs against what it says of them)
    assert [a.path for a in client.list_logged_model_artifacts(model.model_id, "artifacts")] == [
        "artifacts/export.json",
        "artifacts/model.jax_export",
    ]


@pytest.mark.parametrize("ended", ["crashed", "preempted"])
def test_train_metrics_lost_with_their_process_are_logged_by_the_rerun(
    job_config, monkeypatch, ended
):
    # MLflow writes are asynchronous: a process can die after a checkpoint commits and before
    # that interval's metrics reach MLflow. They travel in the checkpoint, and the rerun logs them.
    # A preempted attempt (SIGTERM during the save) logs its goodput at that step as it ends:
    # those metrics are no train metrics, and do not hide the missing ones.
    config = job_config(max_steps=40, every_steps=20, job=f"lost-{ended}")
    first = Trainer(config)
    first.restore_or_init()
    with monkeypatch.context() as m:
        m.setattr(
            Tracker, "log_new_metrics", lambda self, rows, prefix="": None
        )  # the writes never happen
        first.train_until_checkpoint()
        first.job.checkpoints.wait()
    if ended == "preempted":
        first.finish(
            "KILLED"
        )  # as a SIGTERM's handler ends it: goodput/* at step 20, the run KILLED
        assert 20 in [m.step for m in history_of(first, "goodput/goodput")]
    first.close()
    assert history_of(first, "train/loss") == []

    rerun = Trainer(config)
    assert rerun.restore_or_init() == 20
    rerun.train_until_checkpoint()
    rerun.finish()
    history = history_of(rerun, "train/loss")
    assert sorted(m.step for m in history) == [10, 20, 30, 40]  # each once
    rerun.close()


def test_a_job_resumed_against_another_mlflow_store_says_where_its_records_are(
    job_config, tmp_path, caplog
):
    """The default tracking URI is relative to the working directory: a job resumed from elsewhere
    (or with another URI) cannot find its run, and must say so, not split its history quietly.
    (Said by the MLflow worker process, which looks for the run; logged here as it answers.)"""
    config = job_config(max_steps=40, every_steps=20, job="moved")
    first = Trainer(config)
    first.restore_or_init()
    first.job.tracker.run_id  # noqa: B018 - known (waited for) before the checkpoint records it
    first.train_until_checkpoint()
    first.finish()
    first.close()
    elsewhere = f"sqlite:///{tmp_path}/elsewhere.db"
    rerun = Trainer(config.model_copy(update={"mlflow_tracking_uri": elsewhere}))
    assert rerun.restore_or_init() == 20
    assert rerun.job.tracker.run_id != first.job.tracker.run_id  # (waits for MLflow)
    said = " ".join(caplog.text.split())
    assert f"job moved: its MLflow run {first.job.tracker.run_id}, named by the checkpoint" in said
    assert f"is not in sqlite:///{tmp_path}/elsewhere.db: a new run is made there" in said
    rerun.close()


def test_a_job_resumed_with_another_experiment_goes_on_in_its_runs_and_says_so(
    job_config, mlflow_uri, caplog
):
    """(A probe: another mlflow_experiment on a resumed job was ignored without a word, and the
    tracker kept the given experiment's id for the run's links.)"""
    config = job_config(max_steps=40, every_steps=20, job="exp-moved")
    first = Trainer(config.model_copy(update={"mlflow_experiment": "exp-first"}))
    first.restore_or_init()
    first.job.tracker.run_id  # noqa: B018 - known (waited for) before the checkpoint records it
    first.train_until_checkpoint()
    first.finish()
    first.close()
    rerun = Trainer(config.model_copy(update={"mlflow_experiment": "exp-second"}))
    assert rerun.restore_or_init() == 20
    assert rerun.job.tracker.run_id == first.job.tracker.run_id  # (waits for MLflow)
    client = MlflowClient(mlflow_uri)
    kept = client.get_experiment_by_name("exp-first").experiment_id
    assert rerun.job.tracker.experiment_id == kept
    assert client.get_experiment_by_name("exp-second") is None  # (nothing made where unused)
    said = " ".join(caplog.text.split())
    assert (
        f"job exp-moved: its MLflow run {first.job.tracker.run_id} is in experiment 'exp-first', "
        "not 'exp-second' as given: it goes on there"
    ) in said, said[-2000:]
    assert "Give --mlflow-experiment exp-first (mlflow_experiment)" in said
    rerun.close()


def test_eval_metrics_lost_with_their_process_are_logged_from_the_eval_record(
    job_config, monkeypatch
):
    config = job_config(max_steps=40, every_steps=20)
    first = Trainer(config)
    first.restore_or_init()
    first.train_until_checkpoint()
    first.job.checkpoints.wait()  # (committed: the evaluation is recorded before it returns)
    with monkeypatch.context() as m:
        m.setattr(
            Tracker, "log_metrics_once", lambda self, rows, key, step: None
        )  # the write never happens
        assert first.evaluate_if_new().status.value == "EVALUATED"
    first.close()
    assert history_of(first, "eval/accuracy") == []

    rerun = Trainer(config)
    assert rerun.restore_or_init() == 20
    rerun.train_until_checkpoint()
    rerun.evaluate_if_new()
    rerun.finish()
    history = history_of(rerun, "eval/accuracy")
    assert sorted(m.step for m in history) == [20, 40]  # step 20 from its record, once
    rerun.close()


def test_mlflow_runs_in_a_worker_process_and_dies_with_the_trainer(job_config, tmp_path):
    # MLflow's import, its store and every write are Python work: in a worker process, none of
    # it holds the training process's GIL. The trainer's process never imports MLflow at all,
    # and a SIGKILLed trainer leaves no worker behind that could log what its rerun logs again.
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    config = job_config(max_steps=20, every_steps=10)
    script = (
        "import json, sys, time\n"
        "from prefect_jax.training.specs import JobConfig\n"
        "from prefect_jax.training.trainer import Trainer\n"
        "from prefect_jax.training.mlflow_client import worker\n"
        f"trainer = Trainer(JobConfig.model_validate_json({config.model_dump_json()!r}))\n"
        "trainer.restore_or_init()\n"
        "while trainer.step < 20:\n"
        "    trainer.train_until_checkpoint()\n"
        "    trainer.evaluate_if_new()\n"
        "trainer.finish()\n"
        "print(json.dumps({'mlflow_imported': 'mlflow' in sys.modules,\n"
        "                  'run_id': trainer.job.tracker.run_id,\n"
        "                  'worker': worker().process.pid}), flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        out = json.loads(proc.stdout.readline())
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert out["mlflow_imported"] is False
    client = MlflowClient(config.mlflow_tracking_uri)
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(out["run_id"], "train/loss")) == [
        10,
        20,
    ]
    assert sorted(m.step for m in client.get_metric_history(out["run_id"], "eval/accuracy")) == [
        10,
        20,
    ]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{out['worker']}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{out['worker']}"), (
        "the MLflow worker outlived its SIGKILLed trainer"
    )


def test_a_dead_mlflow_worker_warns_once_and_training_goes_on(job_config, monkeypatch):
    import os
    import signal
    import time

    from prefect_jax.training import mlflow_client

    monkeypatch.setenv("PREFECT_JAX_MLFLOW_STRICT", "0")
    trainer = Trainer(job_config(max_steps=40, every_steps=10))
    trainer.restore_or_init()
    trainer.job.tracker.flush()
    worker = mlflow_client.worker()
    # (the warning may come from the worker's reader as it sees the exit, for a call of another
    # thread of the trainer's still waiting then, or from the next call: caught either way)
    with pytest.warns(TrackingWarning, match="MLflow worker process exited") as caught:
        os.kill(worker.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while worker.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        train_to_end(trainer)
        trainer.finish()
    assert trainer.step == 40
    assert sum("worker process exited" in str(w.message) for w in caught) == 1, [
        str(w.message) for w in caught
    ]
    # The next tracker gets a new one.
    assert mlflow_client.worker() is not worker and mlflow_client.worker().alive


def test_warm_up_creates_a_new_sqlite_store_before_the_first_tracker_asks(tmp_path):
    # A new store's schema takes seconds; the command asks for it before its own imports, so that
    # they overlap. A tracker that starts meanwhile waits for it instead of creating it again.
    import time

    from prefect_jax.training import mlflow_client

    alone = tmp_path / "alone.db"
    mlflow_client.warm_up(f"sqlite:///{alone}")  # no tracker asks: the worker creates it anyway
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not alone.exists():
        time.sleep(0.05)
    assert alone.exists(), "warm_up did not open the new store"

    uri = f"sqlite:///{tmp_path / 'raced.db'}"
    mlflow_client.warm_up(uri)
    tracker = Tracker(
        uri, "prefect-jax", "warm-job"
    )  # asks at once, while the store is still being created
    tracker.start({"p": "1"})
    tracker.finish("FINISHED")
    runs = MlflowClient(uri).search_runs([tracker.experiment_id], f"tags.`{JOB_TAG}` = 'warm-job'")
    assert [r.info.status for r in runs] == ["FINISHED"]
    assert sorted(e.name for e in MlflowClient(uri).search_experiments()) == [
        "Default",
        "prefect-jax",
    ]


@pytest.mark.parametrize("template", ["made meanwhile", "none"])
def test_a_store_creation_killed_part_way_leaves_no_store_and_the_next_warm_up_makes_it(
    tmp_path, template
):
    # A command refused for bad input ends within a second or two, while its MLflow worker may be
    # building a new store's schema: it must not leave a half-migrated database under the name.
    # Both places the migrations run: the cache's empty store (the first new store of a machine),
    # and the store itself where the cache cannot be written.
    import glob
    import os
    import signal
    import subprocess
    import sys
    import time

    from prefect_jax.training.mlflow_store import NEW_STORE_SUFFIX

    db, cache = tmp_path / "mlflow.db", tmp_path / "cache"
    if template == "none":
        cache.write_text("a file, not a folder: no template can be kept here")
    building = str(cache / "mlflow-store-templates" / "*.db") if template != "none" else str(db)
    env = dict(os.environ, PREFECT_JAX_CACHE_DIR=str(cache))
    uri = f"sqlite:///{db}"
    script = (
        "import sys, time\nfrom prefect_jax.training import mlflow_client\n"
        f"mlflow_client.warm_up({uri!r})\n"
        "print(mlflow_client.worker().process.pid, flush=True)\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        worker = int(proc.stdout.readline())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not glob.glob(building + NEW_STORE_SUFFIX + "*"):
            time.sleep(0.01)
        assert glob.glob(building + NEW_STORE_SUFFIX + "*"), (
            "the schema was not being built beside its name"
        )
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the command, mid-creation; its worker dies with it
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{worker}"):
        time.sleep(0.05)
    assert not db.exists(), "a half-built store took the database's name"
    assert not glob.glob(building), "a half-built template took its name"
    assert glob.glob(building + NEW_STORE_SUFFIX + "*"), (
        "nothing left to clean up: the kill came too late to test"
    )

    script = (
        "from prefect_jax.training import mlflow_client, tracking\n"
        f"mlflow_client.warm_up({uri!r})\n"
        f"tracker = tracking.Tracker({uri!r}, 'prefect-jax', 'after-kill')\n"
        "tracker.start({'p': '1'})\ntracker.finish('FINISHED')\n"
    )
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    client = MlflowClient(uri)
    assert [
        r.info.status
        for r in client.search_runs([client.get_experiment_by_name("prefect-jax").experiment_id])
    ] == ["FINISHED"]
    assert not glob.glob(building + NEW_STORE_SUFFIX + "*"), (
        "the killed worker's file was not removed"
    )
    if template != "none":
        assert glob.glob(building), "the next new store did not make the template again"


def test_new_stores_are_copies_of_one_empty_store_each_with_its_own_default_experiment(
    tmp_path, monkeypatch
):
    # MLflow's migrations (seconds of CPU) run once per machine, for the cache's empty store; each
    # new store is a copy of it, opened by MLflow, which adds the store's own default experiment.
    # A template that MLflow cannot open is removed, and that store made by the migrations.
    import sqlite3

    from prefect_jax.training.mlflow_store import create_sqlite_store

    monkeypatch.setenv("PREFECT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    create_sqlite_store(str(tmp_path / "a" / "mlflow.db"))
    [template] = (tmp_path / "cache" / "mlflow-store-templates").glob("*.db")
    with sqlite3.connect(template) as db:
        assert db.execute("SELECT COUNT(*) FROM experiments").fetchone() == (
            0,
        )  # no experiment: each store names its own
        db.execute("PRAGMA user_version = 4242")  # a mark that copies carry

    def store(name: str) -> int:
        (tmp_path / name).mkdir()
        create_sqlite_store(str(tmp_path / name / "mlflow.db"))
        with sqlite3.connect(tmp_path / name / "mlflow.db") as db:
            mark = db.execute("PRAGMA user_version").fetchone()[0]
        client = MlflowClient(f"sqlite:///{tmp_path / name / 'mlflow.db'}")
        run = client.create_run(client.create_experiment(f"exp-{name}"))
        client.log_metric(run.info.run_id, "loss", 0.5, step=1)
        assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [0.5]
        assert [e.name for e in client.search_experiments() if e.experiment_id == "0"] == [
            "Default"
        ]
        return mark

    assert store("b") == 4242, "the store was not copied from the template"
    template.write_bytes(b"not a database" * 100)
    assert store("c") == 0  # made by MLflow's migrations instead
    assert not template.exists(), "an unusable template was kept"
    assert store("d") == 0 and template.exists()  # made again, by the next new store


WARM_REGISTRY = r"""
import json, sys, time
from prefect_jax.training import mlflow_client, tracking
uri, how = sys.argv[1], sys.argv[2]
mlflow_client.warm_up(uri, registry=how == "warm_up")  # the command's way, before its own imports
tracker = tracking.Tracker(uri, "prefect-jax", "warm-" + how)
tracker.start({"p": "1"})
tracker.flush()  # MLflow imported in the worker, its store open, the run made
pid = mlflow_client.worker().process.pid

def jax_in_worker():
    with open(f"/proc/{pid}/maps") as f:
        return "jaxlib" in f.read()

if how == "tracker":  # the trainer's way, once it evaluates
    asked = tracker.warm_registry()
    assert tracker.warm_registry() is asked  # asked once per worker
    asked.result(300)  # (its error, if it failed)
deadline = time.monotonic() + (120 if how == "warm_up" else 3)
while time.monotonic() < deadline and not jax_in_worker():
    time.sleep(0.05)
loaded = jax_in_worker()
if how == "warm_up" and loaded:  # the command's request's answer (its error, if it failed)
    mlflow_client.worker().warm_registry().result(300)
print(json.dumps({"jax": loaded}), flush=True)
tracker.finish("FINISHED")
"""


@pytest.mark.parametrize("how", ["warm_up", "tracker", "none"])
def test_the_mlflow_worker_readies_jax_for_a_job_that_registers_exports_and_only_then(
    tmp_path, how
):
    """A job that registers its exports has the MLflow worker import JAX and start its CPU client
    (`registry.warm_jax`, `registry.warm_mlflow`) before its first logged model needs them, so
    that model does not hold every later MLflow write behind those imports; one that does not
    keeps JAX out of the worker. The job's JAX_PLATFORMS (here one that does not exist, as
    ``cuda`` on a GPU pool) is not the worker's: it starts JAX's client on the CPU, or the
    request's answer is the error."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="no-such-platform")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = subprocess.run(
        [sys.executable, "-c", WARM_REGISTRY, uri, how],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"jax": how != "none"}, proc.stderr[-3000:]
    assert "making the model registry ready" not in proc.stderr, proc.stderr[-3000:]


def test_the_mlflow_worker_runs_jax_on_the_cpu_unoptimised_unless_the_job_says_otherwise():
    from prefect_jax.training.mlflow_worker import _worker_environment

    job = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_gpu_autotune_level=0", "OTHER": "kept"}
    assert _worker_environment(job) == {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_gpu_autotune_level=0 --xla_backend_optimization_level=0",
        "OTHER": "kept",
        "MLFLOW_UV_AUTO_DETECT": "false",
    }
    assert _worker_environment({})["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
    assert (
        _worker_environment({"XLA_FLAGS": "--xla_backend_optimization_level=2"})["XLA_FLAGS"]
        == "--xla_backend_optimization_level=2"
    )
    assert _worker_environment({"MLFLOW_UV_AUTO_DETECT": "true"})["MLFLOW_UV_AUTO_DETECT"] == "true"
    assert job["JAX_PLATFORMS"] == "cuda"  # the job's own mapping is left as it was


@pytest.mark.parametrize("registers", ["yes", "no exporters", "no registered model"])
def test_a_trainer_that_will_register_exports_has_the_worker_ready_them_when_it_first_evaluates(
    job_config, monkeypatch, registers
):
    from prefect_jax.training.specs import LatestExporter

    asked = []
    monkeypatch.setattr(Tracker, "warm_registry", lambda self: asked.append(self.job_key))
    config = job_config(
        max_steps=40, exporters=[] if registers == "no exporters" else [LatestExporter()]
    )
    if registers == "no registered model":
        config = config.model_copy(
            update={"eval": config.eval.model_copy(update={"registered_model": ""})}
        )
    trainer = Trainer(config)
    try:
        trainer.restore_or_init()
        trainer.train_until_checkpoint()
        assert asked == []  # a trainer that only trains (the `train` role) never asks
        trainer.evaluate_if_new()
        trainer.train_until_checkpoint()
        trainer.evaluate_if_new()
        assert asked == ([trainer.job.tracker.job_key] if registers == "yes" else [])  # once
    finally:
        trainer.close()


def test_the_flows_that_register_exports_have_the_worker_ready_them_at_their_start():
    """One rule for the flows' run tags and the command's MLflow warm-up (`prefect-jax export`
    runs `export_flow`, which registers, as `run` and `evaluate` do)."""
    from prefect_jax.training.specs import EvalSpec, LatestExporter
    from prefect_jax.training.specs import flow_registers_exports as _registers_exports

    spec = EvalSpec(exporters=[LatestExporter()])
    assert [
        _registers_exports(f, spec)
        for f in ("train_and_evaluate", "evaluate", "export_flow", "train")
    ] == [True, True, True, False]
    assert _registers_exports(
        "train_and_evaluate", spec.model_dump(mode="json")
    )  # a deployment's parameters
    assert _registers_exports("train_and_evaluate", {"exporters": [{"kind": "latest"}]})
    assert not _registers_exports(
        "train_and_evaluate", spec.model_copy(update={"registered_model": ""})
    )
    assert not _registers_exports("train_and_evaluate", EvalSpec())
    assert not _registers_exports("train_and_evaluate", None)
