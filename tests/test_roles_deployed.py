"""The trainer and evaluator roles deployed for real, the trainer
preempted and rerun by the automation.

A real ``prefect server start`` (with its services: the triggers and actions services evaluate
automations) and one ``serve`` process serving two deployments, ``train/trainer`` and
``evaluate/evaluator`` (each flow run a child process of serve). The rerun automation of
`prefect_jax.deployments.automations` watches the trainer deployment. Both roles start on one
job; once a checkpoint is committed, only the trainer's flow-run process is SIGKILLed (a
preempted spot node; serve and the evaluator live on). From there the test only watches:
serve sees its child die and marks the run Crashed, the automation sets it AwaitingRetry,
serve runs it again, and it resumes at the newest committed checkpoint. The evaluator, running
all along, must evaluate every committed checkpoint exactly once and nothing uncommitted, the
job must end bit for bit where an uninterrupted run ends, and MLflow must hold one FINISHED
run for the job.

At the same time, on the same server, serve and trainer deployment, the rerun budget: the
trainer of a second job, with ``max_reruns_without_progress=0``, killed before its first
checkpoint, is rerun by the automation once, and that rerun fails (Failed, not Crashed) saying
it made no progress; the automation does not react to Failed, so the loop ends there.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from deployment_helpers import (
    EVALUATOR,
    TRAINER,
    PrefectServerProcess,
    ServeProcess,
    checkpoint_fingerprint,
    dead,
    job_config,
    logs,
    start_deployment_run,
    wait_for_deployments,
)
from process_helpers import settled_task_runs

pytestmark = pytest.mark.slow

TINY = "prefect_jax.examples.digits:tiny"
MAX_STEPS = 800
EVERY = 100
LOG_EVERY = 50
KILL_FROM = 200  # SIGKILL the trainer once this step (or a later one) is committed
STEPS = list(range(EVERY, MAX_STEPS + 1, EVERY))
EVALUATOR_EXTRA = {"poll_secs": 0.5, "every_checkpoint": True}


def _params(storage: Path, job: str, mlflow_uri: str, **train: object) -> dict:
    """The deployment runs' parameters (both roles get the same job), JSON as typed in the UI."""
    return {
        "program": TINY,
        "job": job,
        "storage": str(storage),
        "train_spec": {"max_steps": MAX_STEPS, "log_every_steps": LOG_EVERY, **train},
        "checkpoint_spec": {"every_steps": EVERY, "keep_last": None},
        "mlflow_tracking_uri": mlflow_uri,
    }


def _uninterrupted(config) -> tuple[str, dict[int, dict[str, float]]]:
    """Train the job from scratch to max_steps in this process with the engine, evaluating each
    checkpoint: the final state fingerprint and the eval metrics of every step."""
    from prefect_jax.training.trainer import Trainer

    trainer = Trainer(config)
    metrics: dict[int, dict[str, float]] = {}
    try:
        assert trainer.restore_or_init() == 0
        while trainer.step < config.train.max_steps:
            trainer.train_until_checkpoint()
            result = trainer.evaluate_if_new()
            metrics[result.step] = result.metrics
        trainer.finish()
        return trainer.fingerprint(), metrics
    finally:
        trainer.close()


def _committed(job_dir: Path) -> list[int]:
    from prefect_jax.training.checkpoint_dirs import committed_steps

    return committed_steps(str(job_dir / "checkpoints"))


def _kill(pid: int, timeout: float = 30.0) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while not dead(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dead(pid), f"process {pid} survived SIGKILL"


def _wait_final(client, run_ids, procs, deadline: float) -> dict:
    """``{run id: flow run}`` once every run is in a final state (Crashed excepted: the automation
    turns that into AwaitingRetry), bounded by `deadline` (time.monotonic())."""
    done: dict = {}
    while time.monotonic() < deadline:
        for run_id in run_ids:
            if run_id not in done:
                run = client.read_flow_run(run_id)
                if run.state.is_final() and not run.state.is_crashed():
                    done[run_id] = run
        if len(done) == len(run_ids):
            return done
        for proc in procs:
            assert proc.alive(), f"{proc.log.name} exited\n{logs(*procs)}"
        time.sleep(0.5)
    states = {str(r): client.read_flow_run(r).state for r in run_ids}
    raise AssertionError(f"runs not final in time: {states}\n{logs(*procs)}")


def _wait_for_state(client, run_id, name: str, procs, timeout: float, why: str) -> None:
    """Until the run's state history holds a state called `name`
    (transitions can be quicker than a poll)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if name in _state_names(client, run_id):
            return
        for proc in procs:
            assert proc.alive(), f"{proc.log.name} exited\n{logs(*procs)}"
        time.sleep(0.25)
    raise AssertionError(
        f"{why} within {timeout:.0f}s: states {_state_names(client, run_id)}\n{logs(*procs)}"
    )


def _state_names(client, run_id) -> list[str]:
    return [s.name for s in sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)]


@pytest.mark.timeout(420)
def test_deployed_trainer_killed_is_rerun_by_the_automation_the_evaluator_evaluates_each_step_once(
    tmp_path, processes
):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    from prefect_jax.deployments.automations import RERUN_MESSAGE, create_rerun_automation
    from prefect_jax.training.evaluation import EvalRecords
    from prefect_jax.training.names import JOB_TAG
    from prefect_jax.training.storage import JobStorage

    started = time.monotonic()
    server = PrefectServerProcess(tmp_path / "prefect-server")
    processes.append(server)

    # While the server starts: the uninterrupted run of the same job config in other storage (it
    # also creates the MLflow tables, which takes seconds; each job gets its own MLflow run).
    storage, job, mlflow_uri = tmp_path / "storage", "roles", f"sqlite:///{tmp_path}/mlflow.db"
    params = _params(storage, job, mlflow_uri)
    budget_dir = storage / "budget"
    budget_params = {
        **_params(storage, "budget", mlflow_uri, max_reruns_without_progress=0),
        # (paced steps and one checkpoint at the end: its kill, after the test's reads of the
        # server, must come before its first checkpoint however slow they are)
        "program": "programs:paced",
        "checkpoint_spec": {"every_steps": MAX_STEPS, "keep_last": None},
    }
    expected, expected_metrics = _uninterrupted(
        job_config(_params(tmp_path / "reference", job, mlflow_uri))
    )
    assert sorted(expected_metrics) == STEPS
    marks = {"reference": time.monotonic()}

    server.wait_healthy()
    marks["server"] = time.monotonic()
    job_dir = storage / job
    results = (
        tmp_path / "results"
    )  # flow results persisted, so the summaries the flows returned can be read back
    serve_env = {
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
        "PREFECT_LOCAL_STORAGE_PATH": str(results),
    }
    with (
        temporary_settings({PREFECT_API_URL: server.api_url, PREFECT_LOCAL_STORAGE_PATH: results}),
        get_client(sync_client=True) as client,
    ):
        serve = ServeProcess(
            server.api_url,
            tmp_path / "serve-home",
            tmp_path / "serve.log",
            mode="serve-roles",
            **serve_env,
        )
        processes.append(serve)
        wait_for_deployments(client, serve, [TRAINER, EVALUATOR])
        create_rerun_automation(TRAINER)
        marks["serve"] = time.monotonic()

        trainer_run = start_deployment_run(TRAINER, params)
        evaluator_run = start_deployment_run(EVALUATOR, {**params, **EVALUATOR_EXTRA})
        # At the same time, the rerun budget on a second job of the same trainer deployment.
        budget_run = start_deployment_run(TRAINER, budget_params)
        runs = [trainer_run.id, evaluator_run.id, budget_run.id]

        # Spot nodes lose the trainers: SIGKILL each one's flow-run process (its job's lease
        # names it), and only it: the job's once a step >= KILL_FROM is committed; the budget
        # job's as soon as its run has recorded its attempt, before its first checkpoint, so that
        # its rerun starts at step 0 again.
        lease = budget_lease = budget_attempts = None
        deadline, next_check = time.monotonic() + 150, 0.0
        while lease is None or budget_lease is None:
            if budget_lease is None and (budget_dir / "attempts.json").exists():
                budget_attempts = json.loads((budget_dir / "attempts.json").read_text())
                budget_lease = json.loads((budget_dir / "lease.json").read_text())
                assert (
                    budget_lease["flow_run_id"] == str(budget_run.id)
                    and budget_lease["pid"] in serve.children()
                )
                _kill(budget_lease["pid"])
                assert not _committed(budget_dir), (
                    "the budget job's kill came after its first checkpoint"
                )
            if lease is None and (_committed(job_dir) or [0])[-1] >= KILL_FROM:
                lease = json.loads((job_dir / "lease.json").read_text())
                assert (
                    lease["flow_run_id"] == str(trainer_run.id) and lease["pid"] in serve.children()
                ), (lease, serve.children())
                _kill(lease["pid"])
                marks["kill"] = time.monotonic()
                killed_at = _committed(job_dir)
            if time.monotonic() >= next_check:
                assert time.monotonic() < deadline, (
                    f"the trainers were not both killed in time\n{logs(serve)}"
                )
                assert serve.alive(), f"serve exited\n{logs(serve)}"
                alive = [evaluator_run.id] + [
                    r.id for r, k in ((trainer_run, lease), (budget_run, budget_lease)) if k is None
                ]
                for run_id in alive:  # not yet killed: still running
                    state = client.read_flow_run(run_id).state
                    assert not state.is_final(), (
                        f"run {run_id} ended before its kill: {state}\n{logs(serve)}"
                    )
                next_check = time.monotonic() + 1.0
            time.sleep(0.02)
        resume_from = killed_at[-1]
        assert KILL_FROM <= resume_from < MAX_STEPS, (
            f"the kill did not land mid-run: committed {killed_at}"
        )
        assert budget_attempts == {
            **budget_attempts,
            "step": 0,
            "reruns_without_progress": 0,
            "owner": str(budget_run.id),
            "process": budget_attempts.get("process"),
        }
        assert budget_attempts["process"]  # (host:pid: a task retry there is not a rerun)
        assert serve.alive() and not client.read_flow_run(evaluator_run.id).state.is_final()

        # Nobody helps from here: serve reports the crashes, the automation
        # reruns, serve runs them again.
        for run_id in (trainer_run.id, budget_run.id):
            _wait_for_state(
                client,
                run_id,
                "Crashed",
                [server, serve],
                60,
                "serve did not report its dead child as Crashed",
            )
            _wait_for_state(
                client,
                run_id,
                "AwaitingRetry",
                [server, serve],
                60,
                "the automation did not set AwaitingRetry",
            )
        marks["rerun"] = time.monotonic()
        done = _wait_final(client, runs, [server, serve], deadline=time.monotonic() + 240)
        marks["done"] = time.monotonic()
        trained, evaluated, failed = (
            done[trainer_run.id],
            done[evaluator_run.id],
            done[budget_run.id],
        )
        assert trained.state.is_completed(), f"{trained.state}\n{logs(serve, server)}"
        assert evaluated.state.is_completed(), f"{evaluated.state}\n{logs(serve, server)}"
        assert trained.run_count == 2 and evaluated.run_count == 1, (
            trained.run_count,
            evaluated.run_count,
        )
        history = _state_names(client, trainer_run.id)
        crashed = history.index("Crashed")
        assert history[crashed + 1] == "AwaitingRetry", history
        awaiting = [
            s for s in client.read_flow_run_states(trainer_run.id) if s.name == "AwaitingRetry"
        ]
        assert [s.message for s in awaiting] == [RERUN_MESSAGE], history
        summary, evaluator_summary = trained.state.result(), evaluated.state.result()
        trainer_tasks, evaluator_tasks = (
            settled_task_runs(
                trainer_run.id,
                f"train {MAX_STEPS - EVERY} to {MAX_STEPS}",
                client=client,
                every_run_final=False,
            ),
            settled_task_runs(
                evaluator_run.id, f"evaluate {MAX_STEPS}", client=client, every_run_final=False
            ),
        )

        # The budget job's rerun made no progress (max_reruns_without_progress=0): it failed, saying
        # so, and the automation (which reacts to Crashed only) left it there.
        assert failed.state.is_failed(), f"{failed.state}\n{logs(serve)}"
        assert failed.run_count == 2, failed.run_count
        assert "without getting past step 0" in (failed.state.message or ""), failed.state
        budget_history = _state_names(client, budget_run.id)
        assert (
            budget_history.count("Crashed") == 1 and budget_history.count("AwaitingRetry") == 1
        ), budget_history
        assert budget_history[-1] == "Failed", budget_history

    # -- the trainer: resumed at the newest committed step, ended exactly
    # where an uninterrupted run ends.
    assert summary["final_step"] == MAX_STEPS
    assert summary["state_fingerprint"] == expected
    fingerprint, meta = checkpoint_fingerprint(job_config(params), MAX_STEPS)
    assert fingerprint == expected
    assert meta["prefect.flow_run_id"] == str(trainer_run.id) and meta["pid"] != lease["pid"]
    by_run = {
        n: [
            r.name
            for r in trainer_tasks
            if r.flow_run_run_count == n and r.name.startswith("train ")
        ]
        for n in (1, 2)
    }
    assert by_run[1][0] == f"train 0 to {EVERY}"
    assert by_run[2] == [
        f"train {s} to {s + EVERY}" for s in range(resume_from, MAX_STEPS, EVERY)
    ], by_run
    assert not (job_dir / "lease.json").exists()  # released at the end
    assert _committed(job_dir) == STEPS  # keep_last=None: every checkpoint is still there

    # -- the evaluator: every committed step evaluated exactly once, only after it was committed.
    assert evaluator_summary["evaluated"] == STEPS, evaluator_summary
    assert evaluator_summary["stopped"].startswith("evaluated the final step"), evaluator_summary
    eval_tasks = sorted(r.name for r in evaluator_tasks if r.name.startswith("evaluate "))
    assert eval_tasks == sorted(f"evaluate {s}" for s in STEPS), eval_tasks
    assert sorted(p.name for p in (job_dir / "evals" / "eval").iterdir()) == sorted(
        f"{s}.json" for s in STEPS
    )
    records = EvalRecords(JobStorage(str(storage), job), "eval").all()
    assert [r.step for r in records] == STEPS
    for record in records:
        commit = _commit_time(job_dir, record.step)
        assert record.evaluated_at >= commit, (
            f"step {record.step} evaluated at {record.evaluated_at}, committed at {commit}"
        )
        # What an uninterrupted run measures at that step: the evaluator saw the committed state.
        assert record.metrics == expected_metrics[record.step], (
            record.step,
            record.metrics,
            expected_metrics[record.step],
        )

    # -- MLflow: one run for the job, FINISHED, each eval step and train log step once.
    mlflow = MlflowClient(mlflow_uri)
    experiment = mlflow.get_experiment_by_name("prefect-jax")
    key = JobStorage(str(storage), job).job_dir
    (mlflow_run,) = mlflow.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{key}'"
    )
    assert (
        mlflow_run.info.run_id == summary["mlflow_run_id"] and mlflow_run.info.status == "FINISHED"
    )
    run_id = mlflow_run.info.run_id
    assert sorted(m.step for m in mlflow.get_metric_history(run_id, "eval/accuracy")) == STEPS
    assert sorted(m.step for m in mlflow.get_metric_history(run_id, "train/loss")) == list(
        range(LOG_EVERY, MAX_STEPS + 1, LOG_EVERY)
    )

    print(
        f"\nroles deployed: trainer killed at committed {killed_at}, resumed at {resume_from}; "
        f"states {history}; " + ", ".join(f"{k} +{v - started:.0f}s" for k, v in marks.items())
    )


def _commit_time(job_dir: Path, step: int) -> float:
    """When Orbax committed `step`: the mtime of its commit file, written last."""
    from prefect_jax.training.names import ORBAX_COMMIT_FILE as _COMMIT_FILE

    return os.stat(job_dir / "checkpoints" / str(step) / _COMMIT_FILE).st_mtime
