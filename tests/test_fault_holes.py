"""Holes found when the job was attacked (issue 10), each shown with a real process or a real file:

- SIGTERM while a checkpoint is being saved (between intervals) commits that step;
- evaluations, eval records and exports exist only for committed steps, and after any kill
  the exporters equal an uninterrupted run's;
- an evaluator killed before its MLflow writes landed loses no eval metric;
- a bit flipped in a committed step is caught by its checksums, and the step is moved aside;
- retention keeps the steps a separate evaluator has not reached yet.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys

import pytest
from conftest import train_and_close
from mlflow.tracking import MlflowClient
from process_helpers import (
    TESTS_DIR,
    cli_env,
    job_args,
    orbax_tmp_dirs,
    start_run,
    status,
    wait_until,
)

from prefect_jax.training.checkpoint_dirs import committed_steps
from prefect_jax.training.exporters import list_exports
from prefect_jax.training.names import STEP_MANIFEST_FILE
from prefect_jax.training.specs import (
    BestExporter,
    CheckpointSpec,
    EvalSpec,
    FinalExporter,
    JobConfig,
    LatestExporter,
    TrainSpec,
)
from prefect_jax.training.storage import JobStorage
from prefect_jax.training.trainer import Trainer

PROGRAM = "programs:big"  # 24 MiB of state: a save lasts long enough to signal a process in it
MAX_STEPS, EVERY = 400, 100


def _run_args(storage, mlflow_uri, job="holes"):
    extra = ("--log-every-steps", "10", "--keep-last", "10")
    return job_args(PROGRAM, job, storage, MAX_STEPS, EVERY, mlflow_uri, *extra)


def _uninterrupted(tmp_path, mlflow_uri):
    """The same job run straight through in this process: its exports, best step and fingerprint."""
    config = JobConfig(
        program=PROGRAM,
        job="straight",
        storage=str(tmp_path / "straight"),
        train=TrainSpec(max_steps=MAX_STEPS, log_every_steps=10),
        checkpoint=CheckpointSpec(every_steps=EVERY, keep_last=10),
        eval=EvalSpec(
            exporters=[LatestExporter(), BestExporter(metric="loss", mode="min"), FinalExporter()]
        ),
        mlflow_tracking_uri=mlflow_uri,
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    while trainer.step < MAX_STEPS:
        trainer.train_until_checkpoint()
        trainer.export(trainer.evaluate_if_new())
    fingerprint = trainer.fingerprint()
    trainer.finish()
    trainer.close()
    storage = trainer.job.storage
    return (
        list_exports(storage),
        storage.read_json(storage.export_dir("best") + "/best.json"),
        fingerprint,
    )


@pytest.mark.slow
def test_sigterm_during_a_save_and_kills_around_an_evaluation_lose_nothing(
    tmp_path, prefect_server, mlflow_uri
):
    storage = str(tmp_path / "storage")
    ckpt = os.path.join(storage, "holes", "checkpoints")
    evals = os.path.join(storage, "holes", "evals", "eval")
    logs = tmp_path / "logs"
    logs.mkdir()

    # 1. SIGTERM while step 200 is being saved (after its interval, before its commit).
    proc = start_run(_run_args(storage, mlflow_uri), prefect_server, logs / "1.log")
    wait_until(lambda: committed_steps(ckpt) == [100], 240, "step 100 to commit", proc)
    wait_until(lambda: orbax_tmp_dirs(ckpt, 200), 120, "the save of step 200 to start", proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    log1 = (logs / "1.log").read_text()
    at = int(re.search(r"SIGTERM at step (\d+)", log1).group(1))
    assert at == 200, log1[-3000:]
    assert "step 200 committed" in log1, log1[-3000:]
    assert committed_steps(ckpt)[-1] == 200, "the step whose save was in flight is committed"
    assert all(
        int(os.path.basename(p)[:-5]) in committed_steps(ckpt) for p in glob.glob(f"{evals}/*.json")
    )
    # Its train metrics are in MLflow already, up to the step committed (no rerun needed for them).
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("prefect-jax").experiment_id],
        filter_string=f"tags.`prefect_jax.job` = '{storage}/holes'",
    )
    logged = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert logged == list(range(10, 201, 10)), logged

    # 2. SIGKILL as soon as the final step's evaluation is recorded, or its checkpoint commits,
    #    whichever comes first: an eval record must never exist for a step that is not committed.
    proc = start_run(_run_args(storage, mlflow_uri), prefect_server, logs / "2.log")
    wait_until(
        lambda: orbax_tmp_dirs(ckpt, MAX_STEPS), 240, f"the save of step {MAX_STEPS} to start", proc
    )
    wait_until(
        lambda: os.path.exists(f"{evals}/{MAX_STEPS}.json") or MAX_STEPS in committed_steps(ckpt),
        120,
        f"step {MAX_STEPS} to be evaluated or committed",
        proc,
    )
    proc.kill()
    proc.wait(timeout=60)
    if os.path.exists(f"{evals}/{MAX_STEPS}.json"):
        assert MAX_STEPS in committed_steps(ckpt), (
            "step 400 was recorded as evaluated before it was committed"
        )

    # 3. Run to the end: the same exporters (steps and best) and state as an uninterrupted run.
    proc = start_run(_run_args(storage, mlflow_uri), prefect_server, logs / "3.log")
    assert proc.wait(timeout=400) == 0, (logs / "3.log").read_text()[-3000:]
    summary = json.loads((logs / "3.log").read_text().strip().splitlines()[-1])
    exports, best, fingerprint = _uninterrupted(tmp_path, mlflow_uri)
    assert summary["final_step"] == MAX_STEPS and summary["state_fingerprint"] == fingerprint
    assert summary["exports"] == exports and exports["final"] == [MAX_STEPS]
    js = JobStorage(storage, "holes")
    assert js.read_json(js.export_dir("best") + "/best.json")["step"] == best["step"]
    job = status("holes", storage)
    assert job["evaluated_steps"]["eval"] == job["committed_steps"] == [100, 200, 300, 400]
    client = MlflowClient(mlflow_uri)
    history = client.get_metric_history(summary["mlflow_run_id"], "eval/loss")
    assert sorted(m.step for m in history) == [100, 200, 300, 400], (
        "each evaluation in MLflow exactly once"
    )
    # The train metrics of the interval whose save the SIGTERM met (its process ended before
    # logging them; the checkpoint carries them), and every other, each exactly once.
    train = sorted(
        m.step for m in client.get_metric_history(summary["mlflow_run_id"], "train/loss")
    )
    assert train == list(range(10, MAX_STEPS + 1, 10)), train


def _trained_without_evaluator(job_config, **kw):
    config = job_config(max_steps=60, every_steps=10, keep_last=1, **kw)
    config = config.model_copy(
        update={"checkpoint": config.checkpoint.model_copy(update={"keep_until_evaluated": True})}
    )
    train_and_close(config)
    return config


@pytest.mark.slow
def test_a_killed_evaluator_loses_no_eval_metric(job_config, prefect_server, mlflow_uri, tmp_path):
    """The evaluator writes its eval records, then is SIGKILLed while its MLflow writes wait on a
    locked store: the next evaluator logs every recorded evaluation, each exactly once."""
    config = _trained_without_evaluator(job_config)
    steps = committed_steps(JobStorage(config.storage, config.job).checkpoint_dir)
    assert steps == [10, 20, 30, 40, 50, 60], "retention kept the steps no evaluator has reached"
    params = {
        "program": config.program,
        "job": config.job,
        "storage": config.storage,
        "train_spec": config.train.model_dump(mode="json"),
        "checkpoint_spec": config.checkpoint.model_dump(mode="json"),
        "mlflow_tracking_uri": mlflow_uri,
        "poll_secs": 0.2,
        "idle_timeout_secs": 600,
    }
    code = f"from prefect_jax.flows import evaluate; evaluate(**{params!r})"
    db = sqlite3.connect(mlflow_uri[len("sqlite:///") :], timeout=30, isolation_level=None)
    db.execute(
        "BEGIN EXCLUSIVE"
    )  # MLflow is reachable but every write waits (a slow tracking server)
    records = JobStorage(config.storage, config.job).eval_dir("eval")
    log = open(tmp_path / "evaluator.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=TESTS_DIR,
        env=cli_env(prefect_server, PREFECT_JAX_MLFLOW_STRICT="0"),
    )
    try:
        wait_until(
            lambda: len(glob.glob(f"{records}/*.json")) == len(steps),
            240,
            "every step to be recorded",
            proc,
            poll=0.05,
        )
    finally:
        proc.kill()
        proc.wait(timeout=60)
        db.execute("ROLLBACK")
        db.close()
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("prefect-jax").experiment_id],
        filter_string=f"tags.`prefect_jax.job` = '{os.path.join(config.storage, config.job)}'",
    )
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [], (
        "the killed evaluator wrote nothing"
    )

    from prefect_jax.flows import evaluate

    evaluate(**dict(params, idle_timeout_secs=0.5))  # nothing new to evaluate: it only catches up
    for key in ("eval/accuracy", "eval/loss"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == steps, key


def test_retention_keeps_what_the_evaluator_has_not_reached(job_config):
    config = _trained_without_evaluator(job_config)
    ckpt = JobStorage(config.storage, config.job).checkpoint_dir
    evaluator = Trainer(config)
    for step in (10, 20, 30):
        assert evaluator.evaluate_if_new(step).status.value == "EVALUATED"
    evaluator.close()
    trainer = Trainer(
        config.model_copy(update={"train": config.train.model_copy(update={"max_steps": 70})})
    )
    trainer.restore_or_init()
    # its save applies retention: keep_last=1, and 30.. (not evaluated yet)
    trainer.train_until_checkpoint()
    trainer.finish()
    trainer.close()
    assert committed_steps(ckpt) == [30, 40, 50, 60, 70]


def _flip_one_bit(step_dir: str) -> str:
    files = [f for f in glob.glob(f"{step_dir}/state/**/*", recursive=True) if os.path.isfile(f)]
    biggest = max(files, key=os.path.getsize)
    data = bytearray(open(biggest, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(biggest, "wb").write(bytes(data))
    return biggest


def test_a_flipped_bit_is_caught_and_the_step_moved_aside(job_config, caplog):
    config = job_config(max_steps=60, every_steps=20)
    straight = Trainer(config.model_copy(update={"job": "straight"}))
    straight.restore_or_init()
    while straight.step < 60:
        straight.train_until_checkpoint()
    clean = straight.fingerprint()
    straight.finish()
    straight.close()
    ckpt = straight.job.storage.checkpoint_dir
    assert os.path.isfile(os.path.join(ckpt, "60", STEP_MANIFEST_FILE))

    damaged = _flip_one_bit(os.path.join(ckpt, "60"))
    rerun = Trainer(config.model_copy(update={"job": "straight"}))
    assert rerun.restore_or_init() == 40
    assert "is corrupt" in caplog.text and os.path.basename(damaged) in caplog.text
    assert [n for n in os.listdir(ckpt) if n.startswith("60.corrupt-")], os.listdir(ckpt)
    rerun.train_until_checkpoint()
    assert rerun.step == 60 and rerun.fingerprint() == clean
    rerun.finish()
    rerun.close()


def test_a_step_written_before_checksums_restores_with_a_warning(job_config, caplog):
    config = job_config(max_steps=20, every_steps=20)
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.finish()
    trainer.close()
    os.remove(os.path.join(trainer.job.storage.checkpoint_dir, "20", STEP_MANIFEST_FILE))
    again = Trainer(config)
    assert again.restore_or_init() == 20
    assert "has no checksums" in caplog.text
    again.close()


@pytest.mark.slow
@pytest.mark.parametrize("cancelled", [False, True], ids=["preempted", "cancelled"])
def test_sigterm_while_prefect_creates_a_task_run_ends_terminated_not_failed(
    tmp_path, prefect_server, mlflow_uri, cancelled
):
    """Prefect's crash handling fails if SIGTERM lands while it creates a task run ("Task run is
    not set"), turning a preemption into a Failed run and an error exit. The run still ends as
    terminated: exit 143, flow run Crashed (what rerun automations match), MLflow run KILLED;
    never Crashed where a person cancelled it (the signal was the cancel's)."""
    import httpx

    storage = str(tmp_path / "storage")
    job = "cancelled" if cancelled else "in-creation"
    args = [
        "run",
        "--program",
        "prefect_jax.examples.digits:tiny",
        "--job",
        job,
        "--storage",
        storage,
        "--max-steps",
        "40",
        "--checkpoint-every-steps",
        "20",
        "--mlflow-tracking-uri",
        mlflow_uri,
        "--no-progress",
    ]
    proc = subprocess.run(
        [sys.executable, "sigterm_in_task_creation.py", *args],
        capture_output=True,
        text=True,
        env={**cli_env(prefect_server), **({"CANCEL_FIRST": "1"} if cancelled else {})},
        cwd=TESTS_DIR,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "Task run is not set" in out, out[-3000:]  # the Prefect failure did happen
    assert proc.returncode == 143, out[-3000:]
    assert "terminated by signal 15; step 20 is committed" in proc.stderr.splitlines()[-1]
    assert status(job, storage)["committed_steps"] == [20]
    (run,) = httpx.post(
        f"{prefect_server}/flow_runs/filter",
        json={"flow_runs": {"tags": {"all_": [f"job:{job}"]}}, "limit": 5},
        timeout=30,
    ).json()
    history = [
        s["type"]
        for s in httpx.get(
            f"{prefect_server}/flow_run_states/", params={"flow_run_id": run["id"]}, timeout=30
        ).json()
    ]
    if cancelled:
        # Never Crashed, even for a moment (what the rerun automation reruns): Prefect refuses
        # the engine's Failed while the run is Cancelling, so the failure hook that would report
        # it Crashed does not run; the runner or worker that cancelled it ends it Cancelled.
        assert run["state_type"] == "CANCELLING" and "CRASHED" not in history, history
    else:
        assert run["state_type"] == "CRASHED", run["state"]
    client = MlflowClient(mlflow_uri)
    (mlflow_run,) = client.search_runs(
        [client.get_experiment_by_name("prefect-jax").experiment_id],
        filter_string=f"tags.`prefect_jax.job` = '{storage}/{job}'",
    )
    assert mlflow_run.info.status == "KILLED"


@pytest.mark.slow
def test_a_save_that_fails_for_want_of_space_fails_the_train_task_and_the_rerun_resumes(
    tmp_path, prefect_server, mlflow_uri
):
    """Issue 53.1: a save refused by the filesystem (here: RLIMIT_FSIZE in the child, whose state
    file cannot be written) fails the train task that made it, the flow run fails and prints no
    summary, nothing uncommitted counts; the rerun once space is back ends as an uninterrupted run.
    """
    storage = str(tmp_path / "storage")
    ckpt = os.path.join(storage, "full", "checkpoints")
    args = [PROGRAM, "full", storage, "20", "10", mlflow_uri]

    def child(limit: int):
        return subprocess.run(
            [sys.executable, os.path.join(TESTS_DIR, "full_disk_child.py"), str(limit), *args],
            env=cli_env(prefect_server),
            cwd=TESTS_DIR,
            capture_output=True,
            text=True,
            timeout=400,
        )

    full = child(8 << 20)  # the 24 MiB state cannot be written; the records and MLflow's can
    log = full.stdout + full.stderr
    assert full.returncode != 0, log[-3000:]
    assert re.search(
        r"Task run 'train \d+ to \d+' - Task run failed with exception: "
        r"CheckpointSaveError\('saving checkpoint step \d+",
        log,
    ), log[-5000:]
    assert "Free space on the storage" in log
    assert re.search(r"Flow run '[^']+' - Finished in state Failed", log), log[-3000:]
    assert '"final_step"' not in log
    assert committed_steps(ckpt) == []
    assert not glob.glob(os.path.join(storage, "full", "evals", "*", "*.json"))

    again = child(0)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    config = JobConfig(
        program=PROGRAM,
        job="straight",
        storage=str(tmp_path / "straight"),
        train=TrainSpec(max_steps=20, log_every_steps=10),
        checkpoint=CheckpointSpec(every_steps=10, keep_last=10),
        mlflow_tracking_uri=mlflow_uri,
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    while trainer.step < 20:
        trainer.train_until_checkpoint()
    fingerprint = trainer.fingerprint()
    trainer.close()
    assert summary["final_step"] == 20 and summary["state_fingerprint"] == fingerprint
    assert committed_steps(ckpt) == [10, 20] and summary["exports"]["latest"] == [10, 20]
