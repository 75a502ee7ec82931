"""Real processes killed with real signals, at several points, resume bit for bit.

One job is run by the `prefect-jax run` command five times in a row against the session's
Prefect server:

1. SIGKILL while an asynchronous checkpoint is being written (its temporary dir exists);
2. SIGTERM mid-interval (before it, a second `run` of the same job fails fast naming the owner);
3. SIGKILL mid-interval (runs 2 and 3 save through the hand-off of `--device-copy`);
4. run to the end: the final state equals an uninterrupted run's, MLflow holds one run
   with each step's metrics once.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient
from process_helpers import (
    TESTS_DIR,
    cli_env,
    job_args,
    job_events,
    orbax_tmp_dirs,
    start_run,
    status,
    wait_until,
)

from prefect_jax.tasks.publish import job_artifact_key
from prefect_jax.training.checkpoint_dirs import committed_steps
from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec
from prefect_jax.training.trainer import Trainer

pytestmark = pytest.mark.slow

PROGRAM = "programs:big"
MAX_STEPS, EVERY = 600, 100


def _start(storage, mlflow_uri, api_url, log_path, *extra: str):
    flags = ("--log-every-steps", "10", "--keep-last", "10", *extra)
    args = job_args(PROGRAM, "pre", storage, MAX_STEPS, EVERY, mlflow_uri, *flags)
    return start_run(args, api_url, log_path)


_wait = wait_until


def _kill(proc, sig):
    proc.send_signal(sig)
    return proc.wait(timeout=120)


def _uninterrupted_fingerprint(
    tmp_path, mlflow_uri, program=PROGRAM, max_steps=MAX_STEPS, every=EVERY
):
    config = JobConfig(
        program=program,
        job="straight",
        storage=str(tmp_path / "straight"),
        train=TrainSpec(max_steps=max_steps),
        checkpoint=CheckpointSpec(every_steps=every),
        mlflow_tracking_uri=mlflow_uri,
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    while trainer.step < max_steps:
        trainer.train_until_checkpoint()
    fingerprint = trainer.fingerprint()
    trainer.finish()
    trainer.close()
    return fingerprint


def test_killed_and_terminated_runs_resume_exactly(tmp_path, prefect_server, mlflow_uri):
    storage = str(tmp_path / "storage")
    ckpt = os.path.join(storage, "pre", "checkpoints")
    logs = tmp_path / "logs"
    logs.mkdir()

    # 1. SIGKILL in the middle of an asynchronous save (of step 200: step 100 is committed).
    proc = _start(storage, mlflow_uri, prefect_server, logs / "1.log")
    _wait(lambda: committed_steps(ckpt) == [100], 180, "step 100 to commit", proc)
    _wait(lambda: orbax_tmp_dirs(ckpt), 60, "the save of step 200 to start", proc)
    assert _kill(proc, signal.SIGKILL) == -signal.SIGKILL
    assert committed_steps(ckpt) == [100], "a save killed part-way must not count"
    killed_save = orbax_tmp_dirs(ckpt)
    assert killed_save, "the killed save left no temporary directory"

    # 2. SIGTERM mid-interval. Before that, with the trainer frozen (SIGSTOP) mid-interval and its
    #    lease fresh, a second run of the same job fails fast, naming the owner.
    #    Runs 2 and 3 save through the hand-off (`--device-copy`: a copy of the state given to
    #    Orbax on a thread, the default on a GPU): the SIGTERM's commit and step 200 go that way.
    proc = _start(storage, mlflow_uri, prefect_server, logs / "2.log", "--device-copy")
    lease_path = os.path.join(storage, "pre", "lease.json")
    _wait(
        lambda: "training from step 100 to 200" in (logs / "2.log").read_text(),
        180,
        "training to resume",
        proc,
    )
    # The rerun's restore removed the killed save's partial step (Orbax would remove it only if
    # it saved step 200 again, so it says so, and the rerun's own save of 200 is not mistaken).
    assert (
        f"removed what killed saves or downloads left in {ckpt}: {killed_save}"
        in (logs / "2.log").read_text()
    )
    proc.send_signal(signal.SIGSTOP)
    try:
        assert json.load(open(lease_path))["pid"] == proc.pid
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "prefect_jax.cli",
                "run",
                "--program",
                PROGRAM,
                "--job",
                "pre",
                "--storage",
                storage,
                "--max-steps",
                str(MAX_STEPS),
                "--mlflow-tracking-uri",
                mlflow_uri,
                "--json",
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            env=cli_env(prefect_server),
            cwd=TESTS_DIR,
            timeout=300,
        )
    finally:
        proc.send_signal(signal.SIGCONT)
    assert second.returncode == 1, second.stderr[-2000:]
    assert (
        "is being trained by another process" in second.stderr
        and f"pid={proc.pid}" in second.stderr
    )
    assert json.load(open(lease_path))["pid"] == proc.pid, (
        "the failed run must leave the owner's lease alone"
    )
    time.sleep(0.3)
    assert _kill(proc, signal.SIGTERM) == 143
    log2 = (logs / "2.log").read_text()
    at = int(re.search(r"SIGTERM at step (\d+): checkpointing it", log2).group(1))
    assert f"step {at} committed" in log2
    assert status("pre", storage)["committed_steps"][-1] == at, (
        "zero steps lost: the step the signal arrived at is committed"
    )
    assert "Finished in state Crashed" in log2 and not os.path.exists(lease_path)
    *_, said, last = [line for line in log2.splitlines() if line.strip()]
    assert said.startswith(  # the command's own last word, after Prefect's crash lines
        f"prefect-jax run: terminated by signal 15; step {at} is committed: run the same "
        "command again to resume there"
    ), said  # (it named no step: the step was only in WARNING lines above, a walkthrough found)
    # and with --json, the same as the last line on stdout
    assert json.loads(last) == {"error": said[len("prefect-jax run: ") :], "exit_code": 143}
    client = MlflowClient(mlflow_uri)
    (killed_run,) = client.search_runs(
        [client.get_experiment_by_name("prefect-jax").experiment_id],
        filter_string=f"tags.`prefect_jax.job` = '{os.path.join(storage, 'pre')}'",
    )
    assert killed_run.info.status == "KILLED"

    # 3. SIGKILL mid-interval, after the next boundary committed.
    proc = _start(storage, mlflow_uri, prefect_server, logs / "3.log", "--device-copy")
    next_boundary = (at // EVERY + 1) * EVERY
    _wait(
        lambda: next_boundary in committed_steps(ckpt), 240, f"step {next_boundary} to commit", proc
    )
    time.sleep(0.5)
    assert _kill(proc, signal.SIGKILL) == -signal.SIGKILL

    # 4. Run to the end.
    proc = _start(storage, mlflow_uri, prefect_server, logs / "4.log")
    assert proc.wait(timeout=400) == 0, (logs / "4.log").read_text()[-3000:]
    summary = json.loads((logs / "4.log").read_text().strip().splitlines()[-1])
    assert summary["final_step"] == MAX_STEPS
    assert summary["state_fingerprint"] == _uninterrupted_fingerprint(tmp_path, mlflow_uri)

    client = MlflowClient(mlflow_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    eval_steps = [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")]
    # The step SIGTERM checkpointed off the cadence was resumed from, and never evaluated.
    cadence = list(range(EVERY, MAX_STEPS + 1, EVERY))
    assert eval_steps == cadence, (
        f"eval steps {eval_steps}; the preemption checkpoint was step {at}"
    )
    assert status("pre", storage)["evaluated_steps"] == {"eval": cadence}
    loss_steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert len(loss_steps) == len(set(loss_steps)), "a train metric was logged twice"

    # What the preemptions cost, as the job's goodput ledger, MLflow and Prefect tell it.
    goodput = status("pre", storage)["goodput"]
    assert goodput["attempts"] == 4 and goodput["interrupted"] == 3, (
        goodput
    )  # the refused run never trained
    assert 0 < goodput["goodput"] < 1 and goodput["steps"] == [0, MAX_STEPS], goodput
    lost = goodput["lost_s"]
    assert lost["recomputed"] > 0, (
        "steps 100 to 200 were trained twice (the save of 200 was killed)"
    )
    assert lost["between_attempts"] > 0 and lost["startup"] > 0 and lost["restore"] > 0, lost
    assert summary["goodput"] == goodput
    metrics = run.data.metrics
    assert (
        metrics["goodput/goodput"] == pytest.approx(goodput["goodput"])
        and metrics["goodput/attempts"] == 4
    )
    assert client.get_metric_history(run.info.run_id, "goodput/goodput")[-1].step == MAX_STEPS
    logged = json.loads(
        open(client.download_artifacts(run.info.run_id, "goodput.json", str(tmp_path))).read()
    )
    assert logged["attempts"] == 4
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as prefect:  # the session's server (prefect_test_harness)
        artifacts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[job_artifact_key("pre", storage, "goodput")])
            ),
            sort=ArtifactSort.CREATED_DESC,
        )
        states = [prefect.read_flow_run(a.flow_run_id).state.type.value for a in artifacts]
    # The run that finished and, before it, the SIGTERMed one (a SIGKILLed run says nothing): the
    # Crashed run's page says what the preemptions had cost so far.
    assert [a.type for a in artifacts] == ["table", "table"] and states == [
        "COMPLETED",
        "CRASHED",
    ], (artifacts, states)
    finished, preempted = artifacts
    assert "recomputed steps" in str(finished.data) and "goodput" in finished.description.lower()
    assert (
        f"stopped by SIGTERM after step {at}" in preempted.description
        and "productive training" in str(preempted.data)
    )
    assert "2 attempt(s), 2 of them interrupted" in preempted.description, preempted.description


def test_after_a_kill_without_notice_reruns_back_up_between_checkpoints_and_resume_from_a_backup(
    tmp_path, prefect_server, mlflow_uri
):
    """`CheckpointSpec.backups`: once an attempt was SIGKILLed, the next ones write resume-only
    checkpoints within each interval (Young/Daly); a rerun resumes from one exactly, and none
    is ever evaluated. The device sets the pace, as a real model's does: the host could queue a
    whole interval long before its first second of steps has run (a data-bound job's backups:
    test_multiprocess)."""
    storage, every, max_steps = str(tmp_path / "storage"), 50, 100
    ckpt = os.path.join(storage, "bk", "checkpoints")
    args = job_args("programs:device_bound", "bk", storage, max_steps, every, mlflow_uri)
    args += ["--keep-last", "20"]
    logs = tmp_path / "logs"
    logs.mkdir()

    def backups() -> list[int]:
        return [s for s in committed_steps(ckpt) if s % every]

    # 1. Killed without notice before its first checkpoint: nothing in
    # the ledger yet, so no backups.
    proc = start_run(args, prefect_server, logs / "1.log")
    _wait(
        lambda: os.path.exists(os.path.join(storage, "bk", "goodput.json")),
        180,
        "the attempt to begin",
        proc,
    )
    time.sleep(1.0)  # compiling, or its first ~10 steps (~100 ms each)
    assert _kill(proc, signal.SIGKILL) == -signal.SIGKILL
    assert committed_steps(ckpt) == [] and "backing up" not in (logs / "1.log").read_text()

    # 2. The rerun backs up between checkpoints (its interval takes ~4 s: ~85 ms a step): the
    #    first after 1 s, as no save was timed yet (a job killed more often than it checkpoints
    #    would otherwise never get past step 0); killed after one.
    proc = start_run(args, prefect_server, logs / "2.log")
    backup = _wait(lambda: backups(), 180, "a backup to commit", proc)[-1]
    assert _kill(proc, signal.SIGKILL) == -signal.SIGKILL
    log2 = (logs / "2.log").read_text()
    assert (
        "1 of its 1 latest attempts were killed without notice" in log2
        and "backing up every 1.0s" in log2
    ), log2[-3000:]
    assert "no save timed yet" in log2
    from prefect_jax.training.steps import job_step_is_backup
    from prefect_jax.training.storage import JobStorage

    assert job_step_is_backup(JobStorage(storage, "bk"), backup)

    # 3. Resumed from the backup (no step before it trained again), to the end: as if never killed.
    proc = start_run(args, prefect_server, logs / "3.log")
    assert proc.wait(timeout=400) == 0, (logs / "3.log").read_text()[-3000:]
    log3 = (logs / "3.log").read_text()
    resumed = int(re.search(r"training from step (\d+) to", log3).group(1))
    assert resumed >= backup and resumed % every, (
        f"resumed from {resumed}, not from the backup {backup} or a later one"
    )
    summary = json.loads(log3.strip().splitlines()[-1])
    assert summary["state_fingerprint"] == _uninterrupted_fingerprint(
        tmp_path, mlflow_uri, "programs:device_bound", max_steps, every
    )
    assert status("bk", storage)["evaluated_steps"] == {"eval": [every, max_steps]}, (
        "a backup was evaluated"
    )
    assert not job_step_is_backup(JobStorage(storage, "bk"), every)
    # An evaluator deployment is triggered by these events: a backup,
    # which it would skip, emits none.
    committed = job_events(
        prefect_server, "bk", storage, "prefect-jax.checkpoint.committed", expect=2
    )
    assert sorted(e["payload"]["step"] for e in committed) == [every, max_steps], (
        "a backup emitted a committed event"
    )
    ledger = json.load(open(os.path.join(storage, "bk", "goodput.json")))["attempts"]
    assert [a.get("backup_every_secs") is not None for a in ledger] == [False, True, True], ledger
    assert all(a["backup_every_secs"] >= 1.0 for a in ledger[1:])
