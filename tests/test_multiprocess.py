"""Several JAX processes train one job: real processes on this machine (`jax.distributed` on
localhost, gloo collectives), launched the ways a user does, killed with real signals.

- ``prefect-jax run --processes 2``: one job, process 0's flow run with process 1's as its child,
  one MLflow run, each checkpoint step holding both processes' Grain iterator state.
- Two processes started by hand with ``PREFECT_JAX_*`` (as a Kubernetes indexed job starts its
  pods): SIGTERM to both saves the same step in both; SIGKILL of one ends the other promptly;
  the reruns end with the uninterrupted run's `state_fingerprint`.
- Resharding: the 2-process checkpoint restores into 1 process bit for bit (on a local disk and
  on ``gs://``), and a 1-process checkpoint into 2.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
from process_helpers import TESTS_DIR, cli_env, job_args, start_run, wait_until

from prefect_jax.training.checkpoint_dirs import committed_steps, read_meta_file
from prefect_jax.training.names import STORAGE_TAG
from prefect_jax.training.peer_watch import LOST_GRACE_SECS
from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec

PROGRAM = "programs:paced"
MAX_STEPS, EVERY = 400, 100


def _args(
    job: str, storage: str, mlflow_uri: str, max_steps: int = MAX_STEPS, every: int = EVERY
) -> list[str]:
    extra = ("--log-every-steps", "10", "--keep-last", "10")
    return job_args(PROGRAM, job, storage, max_steps, every, mlflow_uri, *extra)


def _summary(log_path) -> dict:
    """The ``--json`` summary: process 0's last line on stdout (the other's log lines
    may follow it in a shared file)."""
    return json.loads(
        [line for line in open(log_path).read().splitlines() if line.startswith('{"')][-1]
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_pair(
    args: list[str], api_url: str, tmp_path, name: str, **extra_env: str
) -> list[subprocess.Popen]:
    """Two `prefect-jax run` processes of one job, told who they are by the environment."""
    port = _free_port()
    return [
        start_run(
            args,
            api_url,
            tmp_path / f"{name}.{k}.log",
            PREFECT_JAX_NUM_PROCESSES="2",
            PREFECT_JAX_PROCESS_ID=str(k),
            PREFECT_JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            **extra_env,
        )
        for k in range(2)
    ]


def _wait_all(procs, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(timeout=max(1, deadline - time.monotonic()))
    return [p.returncode for p in procs]


# -- real processes -----------------------------------------------------------------------


def _run_two_processes(storage: str, mlflow_uri: str, api_url: str, log, **env: str) -> dict:
    """``prefect-jax run --processes 2`` of the job, start to end: its summary and storage."""
    with open(log, "w") as out:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "prefect_jax.cli",
                "run",
                *_args("mp", storage, mlflow_uri),
                "--processes",
                "2",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cli_env(api_url, **env),
            cwd=TESTS_DIR,
            timeout=600,
        )
    assert done.returncode == 0, open(log).read()[-4000:]
    return {"summary": _summary(log), "storage": storage, "log": log}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, prefect_server, mlflow_uri):
    tmp = tmp_path_factory.mktemp("two-processes")
    return _run_two_processes(str(tmp / "storage"), mlflow_uri, prefect_server, tmp / "run.log")


slow = pytest.mark.slow


@slow
def test_two_processes_train_one_job_under_one_flow_run_and_one_mlflow_run(
    uninterrupted, prefect_server, mlflow_uri
):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentTaskRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )

    summary, storage = uninterrupted["summary"], uninterrupted["storage"]
    assert summary["final_step"] == MAX_STEPS and summary["eval"]["accuracy"] > 0.8
    checkpoints = os.path.join(storage, "mp", "checkpoints")
    assert committed_steps(checkpoints) == [100, 200, 300, 400]
    # Each step holds both processes' iterator positions, beside the one (replicated) state.
    data = os.path.join(checkpoints, "400", "data")
    assert sorted(n for n in os.listdir(data) if n.endswith(".json")) == [
        "process_0-of-2.json",
        "process_1-of-2.json",
    ]

    # Prefect: process 0's flow run, with process 1's as its child through a "process 1" task run.
    with get_client(sync_client=True) as client:
        # (task run states reach the server as events: the processes sent theirs as they exited,
        # the server may still be recording them)
        def recorded() -> bool:
            tasks = client.read_task_runs(
                flow_run_filter=FlowRunFilter(tags={"all_": ["job:mp"]}), limit=200
            )
            final = [t.name for t in tasks if t.state is not None and t.state.is_final()]
            return (
                final.count("train 300 to 400") >= 2
                and {"evaluate 400", "export 400"} <= set(final)
                and any(n.startswith("process 1") for n in final)
            )

        wait_until(recorded, 30, "the task runs' last states recorded", poll=0.25)
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags={"all_": ["job:mp"]}))
        parents = [r for r in runs if r.parent_task_run_id is None]
        assert len(parents) == 1 and parents[0].state.is_completed(), [
            (r.name, r.state) for r in runs
        ]
        run = parents[0]
        links = client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[run.id]))
        )
        link = [t for t in links if t.name.startswith("process 1")]
        assert len(link) == 1 and link[0].state.is_completed()
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_task_run_id=FlowRunFilterParentTaskRunId(any_=[link[0].id])
            )
        )
        assert [(c.name, c.state.is_completed()) for c in children] == [
            (f"{run.name}-process-1", True)
        ]
        assert children[
            0
        ].idempotency_key  # a resent create gets this run back (test_child_flow_run)
        # Process 1 trained (its own train task runs), process 0 alone evaluated and exported.
        child_tasks = {
            t.name
            for t in client.read_task_runs(
                task_run_filter=TaskRunFilter(
                    flow_run_id=TaskRunFilterFlowRunId(any_=[children[0].id])
                )
            )
        }
        assert "train 300 to 400" in child_tasks and not any(
            n.startswith(("evaluate", "export")) for n in child_tasks
        )
        assert {"train 300 to 400", "evaluate 400", "export 400"} <= {t.name for t in links}

    # MLflow: one run, by process 0, with each eval once.
    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("prefect-jax")
    mine = client.search_runs([experiment.experiment_id], f"tags.`{STORAGE_TAG}` = '{storage}'")
    assert [r.info.run_id for r in mine] == [summary["mlflow_run_id"]]
    accuracy = client.get_metric_history(summary["mlflow_run_id"], "eval/accuracy")
    assert sorted(m.step for m in accuracy) == [100, 200, 300, 400]


def _deployment_run(client, storage: str, mlflow_uri: str):
    """A flow run of a `train_and_evaluate` deployment (entrypoint and pull step as
    prefect.yaml's)."""
    from prefect_jax.flows import train_and_evaluate

    root = os.path.dirname(TESTS_DIR)
    flow_id = client.create_flow(train_and_evaluate)
    deployment_id = client.create_deployment(
        flow_id=flow_id,
        name=f"two-pods-{os.path.basename(os.path.dirname(storage))}",
        entrypoint="prefect_jax/flows/__init__.py:train_and_evaluate",
        path=root,
        pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": root}}],
        parameters={
            "program": PROGRAM,
            "job": "mp",
            "storage": storage,
            "mlflow_tracking_uri": mlflow_uri,
            "train_spec": {"max_steps": MAX_STEPS, "log_every_steps": 10},
            "checkpoint_spec": {"every_steps": EVERY, "keep_last": 10},
        },
    )
    return client.create_flow_run_from_deployment(
        deployment_id, idempotency_key=str(uuid.uuid4())
    )  # one run, however often the client sends it (see start_deployment_run)


def _pods(flow_run_id, api_url: str, tmp_path, name: str) -> list[subprocess.Popen]:
    """The two pods of an indexed job running the flow run: the command and environment the
    multi-process Kubernetes template gives them (``prefect-jax process ...
    -- prefect flow-run execute``)."""
    port = _free_port()
    procs = []
    for k in range(2):
        # As the template's env: on SIGTERM, `prefect flow-run execute` tells its engine process,
        # which checkpoints, and reschedules the run (a worker then starts every pod again).
        env = cli_env(
            api_url,
            PREFECT__FLOW_RUN_ID=str(flow_run_id),
            JOB_COMPLETION_INDEX=str(k),
            PREFECT_JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR="reschedule",
        )
        cmd = [
            sys.executable,
            "-m",
            "prefect_jax.cli",
            "process",
            "--processes=2",
            "--",
            sys.executable,
            "-m",
            "prefect",
            "flow-run",
            "execute",
        ]
        log = open(tmp_path / f"{name}.{k}.log", "w")
        procs.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=TESTS_DIR)
        )
    return procs


@slow
def test_an_indexed_jobs_pods_survive_sigterm_and_sigkill_and_the_retry_resumes_exactly(
    uninterrupted, tmp_path, prefect_server, mlflow_uri
):
    from prefect.client.orchestration import get_client
    from prefect.states import AwaitingRetry

    from prefect_jax.training.trainer import Trainer

    storage = str(tmp_path / "storage")
    checkpoints = os.path.join(storage, "mp", "checkpoints")

    def retry(client, run_id):  # the UI's Retry button
        client.set_flow_run_state(run_id, AwaitingRetry(message="Retry from the UI"), force=True)

    def preempted_step(name: str, after: int) -> int:
        step = committed_steps(checkpoints)[-1]
        assert after < step < after + EVERY, committed_steps(checkpoints)
        data = os.path.join(checkpoints, str(step), "data")
        positions = [
            json.load(open(os.path.join(data, f"process_{k}-of-2.json"))) for k in range(2)
        ]
        assert positions[0] == positions[1]  # the same batches consumed in both processes
        for k in range(2):
            assert (
                f"SIGTERM at step {step}: checkpointing it"
                in open(tmp_path / f"{name}.{k}.log").read()
            )
        return step

    def training_from(procs, name: str, step: int) -> None:
        """Once both pods train from `step` (committed, evaluated, the next train task started:
        on a slow machine that takes a while after the commit), 0.4 s into the interval's 1 s."""
        line = f"training from step {step} to {step + EVERY}"
        wait_until(lambda: step in committed_steps(checkpoints), 300, f"{step} committed", procs[0])
        wait_until(
            lambda: all(line in open(tmp_path / f"{name}.{k}.log").read() for k in range(2)),
            300,
            f"both pods training from step {step}",
            procs[0],
            poll=0.05,
        )
        time.sleep(0.4)

    with get_client(sync_client=True) as client:
        run = _deployment_run(client, storage, mlflow_uri)

        # 1. SIGTERM to pod 1 alone mid-interval (its node is drained): both processes checkpoint
        #    the same step, off the cadence, and the run ends Crashed, for the automation to rerun.
        procs = _pods(run.id, prefect_server, tmp_path, "one")
        training_from(procs, "one", 100)
        procs[1].send_signal(signal.SIGTERM)
        _wait_all(procs, 120)
        preempted_step("one", 100)
        assert "another process of the job got SIGTERM" in open(tmp_path / "one.0.log").read()
        assert client.read_flow_run(run.id).state.is_crashed()
        # Pod 1 reported its own run's end: pod 0, where JAX's coordination service runs, exited
        # after it (JAX aborts a process whose service went away).
        log1 = open(tmp_path / "one.1.log").read()
        assert "Terminating process" not in log1, log1[-3000:]
        assert "prefect.flow_runs:Finished in state Crashed" in log1, log1[-3000:]

        # 2. Retry; SIGTERM to both pods: the same, and pod 0's supervisor reschedules the run.
        retry(client, run.id)
        procs = _pods(run.id, prefect_server, tmp_path, "term")
        training_from(procs, "term", 200)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        _wait_all(procs, 120)
        preempted_step("term", 200)
        assert client.read_flow_run(run.id).state.name == "AwaitingRetry"

        # 3. The rerun; SIGKILL pod 1 the moment step 300 commits (process 0 renamed it; Orbax's
        #    save threads still meet at their last barriers, where nothing but the peer watch tells
        #    pod 0 of a dead peer before JAX's 30 s heartbeat timeout, which aborts it, Crashed):
        #    pod 0 records the committed step's evaluation and ends Failed within seconds.
        procs = _pods(run.id, prefect_server, tmp_path, "kill")
        wait_until(lambda: 300 in committed_steps(checkpoints), 300, "step 300 committed", procs[0])
        procs[1].send_signal(signal.SIGKILL)
        started = time.monotonic()
        codes = _wait_all(procs, 120)
        assert (
            codes[1] == -signal.SIGKILL
        )  # pod 0's `prefect flow-run execute` exits 0 whatever its run's state
        log = open(tmp_path / "kill.0.log").read()
        # (under JAX's 30 s heartbeat timeout, with room for a loaded machine's slow exit)
        assert time.monotonic() - started < 27, f"pod 0 waited on its lost peer: {log[-3000:]}"
        state = client.read_flow_run(run.id).state
        assert state.is_failed() and "connection" in state.message.lower(), state
        assert "Terminating process" not in log, log[
            -3000:
        ]  # no SIGABRT from JAX's coordination service
        assert log.count("not waiting for the save in flight") <= 1, log[
            -3000:
        ]  # the trainer's and the job's end: said once
        assert os.path.exists(os.path.join(storage, "mp", "evals", "eval", "300.json")), log[
            -3000:
        ]  # not evaluated again

        # 4. Retry: the job ends where an uninterrupted run ends, bit for bit.
        retry(client, run.id)
        procs = _pods(run.id, prefect_server, tmp_path, "end")
        assert _wait_all(procs, 300) == [0, 0], open(tmp_path / "end.0.log").read()[-3000:]
        assert client.read_flow_run(run.id).state.is_completed()
        assert committed_steps(checkpoints)[-1] == MAX_STEPS

    # The two processes' final checkpoint, restored in this one process: the uninterrupted state.
    config = JobConfig(
        program=PROGRAM,
        job="mp",
        storage=storage,
        train=TrainSpec(max_steps=MAX_STEPS),
        checkpoint=CheckpointSpec(every_steps=EVERY, keep_last=10),
        mlflow_tracking_uri=mlflow_uri,
    )
    trainer = Trainer(config)
    try:
        assert trainer.restore_or_init() == MAX_STEPS
        assert trainer.fingerprint() == uninterrupted["summary"]["state_fingerprint"]
        goodput = trainer.goodput()
        assert (
            goodput["attempts"] == 5 and goodput["interrupted"] == 3
        )  # the pods' four, and this restore
    finally:
        trainer.close()


def _config(storage: str, max_steps: int, mlflow_uri: str) -> JobConfig:
    return JobConfig(
        program=PROGRAM,
        job="mp",
        storage=storage,
        train=TrainSpec(max_steps=max_steps, log_every_steps=10),
        checkpoint=CheckpointSpec(every_steps=EVERY, keep_last=10),
        mlflow_tracking_uri=mlflow_uri,
    )


def _resumes_two_processes_step_in_one(uninterrupted, storage, mlflow_uri, caplog) -> None:
    """This (one-process) test restores the two processes' last step bit for bit, with the data
    position, and trains on."""
    from prefect_jax.training.trainer import Trainer

    trainer = Trainer(_config(storage, MAX_STEPS + EVERY, mlflow_uri))
    with caplog.at_level("WARNING", logger="prefect_jax.checkpoints"):
        assert trainer.restore_or_init() == MAX_STEPS
    assert "written by 2 processes, restored into 1" in caplog.text
    assert trainer.fingerprint() == uninterrupted["summary"]["state_fingerprint"]
    trainer.train_until_checkpoint()
    assert trainer.step == MAX_STEPS + EVERY and trainer.last_train_metrics["loss"] < 1.0
    trainer.finish()
    trainer.close()


@slow
def test_checkpoints_reshard_between_two_processes_and_one(
    uninterrupted, tmp_path, prefect_server, mlflow_uri, caplog
):
    # 2 -> 1
    import shutil

    from prefect_jax.training.trainer import Trainer

    storage = str(tmp_path / "two-to-one")
    shutil.copytree(uninterrupted["storage"], storage)
    _resumes_two_processes_step_in_one(uninterrupted, storage, mlflow_uri, caplog)

    # 1 -> 2: a job checkpointed by one process goes on in two.
    storage = str(tmp_path / "one-to-two")
    trainer = Trainer(_config(storage, MAX_STEPS, mlflow_uri))
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    one_process = trainer.fingerprint()
    trainer.finish()
    trainer.close()
    procs = _start_pair(_args("mp", storage, mlflow_uri), prefect_server, tmp_path, "grow")
    assert _wait_all(procs, 300) == [0, 0], open(tmp_path / "grow.0.log").read()[-3000:]
    for k in range(2):
        log = open(tmp_path / f"grow.{k}.log").read()
        assert "step 100 was written by 1 processes, restored into 2" in log
        assert _summary(tmp_path / f"grow.{k}.log")["final_step"] == MAX_STEPS
    assert one_process != _summary(tmp_path / "grow.0.log")["state_fingerprint"]


@slow
def test_two_processes_train_on_gcs_and_one_resumes_their_step(
    gcs_env, tmp_path, prefect_server, mlflow_uri, caplog
):
    """A job of two processes on ``gs://`` (fake-gcs-server), resumed by one: the step's data
    position is looked for on GCS, where it used to be looked for on a local disk only, so that
    Grain asked for ``process_0-of-1.json`` and the rerun stopped."""
    url = f"gs://{gcs_env.bucket}/two-to-one"
    two = _run_two_processes(url, mlflow_uri, prefect_server, tmp_path / "run.log", **gcs_env.env)
    assert committed_steps(f"{url}/mp/checkpoints")[-1] == MAX_STEPS
    _resumes_two_processes_step_in_one(two, url, mlflow_uri, caplog)


@slow
def test_after_kills_without_notice_every_process_writes_the_same_backups_and_the_rerun_resumes(
    uninterrupted, tmp_path, prefect_server, mlflow_uri
):
    """`CheckpointSpec.backups` with two processes: a process SIGKILLed (process 1: process 0's
    attempt ends ``lost a process``; then process 0 itself: its attempt never ends) makes the
    next attempts back up; both processes write each backup at the same step (one collective
    save), and the rerun resumes from one to the uninterrupted run's state, bit for bit."""
    from prefect_jax.training.goodput_summary import LOST_PROCESS

    every = 2 * EVERY  # intervals of 2-3 s of training: room for backups (at least 1 s apart)
    storage = str(tmp_path / "storage")
    checkpoints = os.path.join(storage, "mpbk", "checkpoints")
    args = _args("mpbk", storage, mlflow_uri, every=every)

    def ledger() -> list[dict]:
        return json.load(open(os.path.join(storage, "mpbk", "goodput.json")))["attempts"]

    def backups() -> list[int]:
        return [s for s in committed_steps(checkpoints) if s % every]

    def kill(procs, k: int, name: str) -> None:
        procs[k].send_signal(signal.SIGKILL)
        _wait_all(procs, 120)  # the other one ends at its next collective
        assert procs[k].returncode == -signal.SIGKILL
        assert procs[1 - k].returncode != 0, open(tmp_path / f"{name}.{1 - k}.log").read()[-3000:]

    # 1. Process 1 killed mid-interval: process 0's attempt fails on the lost connection, which
    #    the ledger counts as a kill of the job. No backups yet.
    procs = _start_pair(args, prefect_server, tmp_path, "one")
    wait_until(
        lambda: every in committed_steps(checkpoints), 300, f"step {every} committed", procs[0]
    )
    time.sleep(0.5)
    kill(procs, 1, "one")
    assert backups() == []
    assert ledger()[-1]["ended"] == LOST_PROCESS, ledger()
    assert "its attempt counts as killed without notice" in open(tmp_path / "one.0.log").read()

    # 2. The rerun backs up between checkpoints, in both processes at
    # once; process 0 killed after one. Its interval is paced to 8 s of training: the backups'
    # period comes from the first attempt's time to its kill (2.7 s in one CI run whose first
    # attempt was slow), and an interval of 2.6 s at the usual pace then ended before it.
    procs = _start_pair(args, prefect_server, tmp_path, "two", PREFECT_JAX_TEST_STEP_SECS="0.04")
    backup = wait_until(lambda: backups(), 300, "a backup committed", procs[0])[-1]
    kill(procs, 0, "two")
    log = open(tmp_path / "two.0.log").read()
    assert (
        "1 of its 1 latest attempts were killed without notice" in log and "backing up every" in log
    ), log[-3000:]
    data = os.path.join(checkpoints, str(backup), "data")
    positions = [json.load(open(os.path.join(data, f"process_{k}-of-2.json"))) for k in range(2)]
    assert positions[0] == positions[1]  # one save of both processes' parts, at the same step
    meta = read_meta_file(checkpoints, backup)
    assert meta["backup"] is True and meta["preemption"] is True

    # 3. Resumed from the backup (or a later one), to the end: as if never killed.
    procs = _start_pair(args, prefect_server, tmp_path, "three")
    assert _wait_all(procs, 300) == [0, 0], open(tmp_path / "three.0.log").read()[-3000:]
    resumed = int(
        re.search(r"training from step (\d+) to", open(tmp_path / "three.0.log").read()).group(1)
    )
    assert resumed >= backup and resumed % every, (
        f"resumed from {resumed}, not from the backup {backup} or a later one"
    )
    for k in range(2):
        assert (
            _summary(tmp_path / f"three.{k}.log")["state_fingerprint"]
            == uninterrupted["summary"]["state_fingerprint"]
        )
    attempts = ledger()
    assert [a["ended"] for a in attempts] == [LOST_PROCESS, None, "finished"], attempts
    assert [a.get("backup_every_secs") is not None for a in attempts] == [False, True, True], (
        attempts
    )


@slow
def test_a_process_that_fails_on_its_own_says_so_and_the_job_is_not_taken_for_killed(
    tmp_path, prefect_server, mlflow_uri
):
    """Process 1's input fails (its error told to process 0 through the coordination service
    before it exits): process 0's collective then fails on the lost connection, but its attempt
    ends ``failed``, not ``lost a process``: no kill, so no backups for a job that fails."""
    storage = str(tmp_path / "storage")
    args = _args("mpbad", storage, mlflow_uri)
    args[args.index(PROGRAM)] = "programs:bad_shard_in_process_1"
    procs = _start_pair(args, prefect_server, tmp_path, "bad")
    codes = _wait_all(procs, 300)
    assert codes[0] != 0 and codes[1] != 0, codes
    log0 = open(tmp_path / "bad.0.log").read()
    assert "shard 7 of process 1 is unreadable" in open(tmp_path / "bad.1.log").read()
    assert "process 1 failed on its own (ValueError: shard 7 of process 1 is unreadable" in log0, (
        log0[-3000:]
    )
    attempts = json.load(open(os.path.join(storage, "mpbad", "goodput.json")))["attempts"]
    assert [a["ended"] for a in attempts] == ["failed"], attempts


@pytest.mark.parametrize("mode, count", [("kill", 3), ("finish", 2)])
def test_a_wait_at_a_barrier_ends_when_another_process_is_killed_not_when_it_finished(
    tmp_path, mode, count
):
    """`cluster.wait_unless_lost`: processes waiting at one of the coordination service's
    barriers (as Orbax's commit does) learn within seconds that a peer was SIGKILLed (process 0:
    its watch connection closed; the others: from process 0), not after JAX's heartbeat timeout
    (30 s), and exit with their own code rather than JAX's SIGABRT, also those that take a second
    to exit (process 0, where the coordination service runs, goes after them); a peer that
    finished its part and left is not taken for lost."""
    port, flag, last = _free_port(), tmp_path / "last-exited", count - 1
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "peer_watch.py", str(k), str(count), str(port), mode, str(flag)],
            stdout=open(tmp_path / f"{k}.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=TESTS_DIR,
        )
        for k in range(count)
    ]
    try:
        for k in range(last):
            wait_until(
                lambda k=k: "waiting" in open(tmp_path / f"{k}.log").read(),
                120,
                f"process {k} waiting",
                procs[k],
            )
        if mode == "kill":
            wait_until(
                lambda: "sleeping" in open(tmp_path / f"{last}.log").read(),
                60,
                "the last process sleeping",
                procs[last],
            )
            procs[last].send_signal(signal.SIGKILL)
        else:
            assert procs[last].wait(timeout=60) == 0
            flag.touch()
        started, exited = time.monotonic(), {}
        for k in range(last):
            procs[k].wait(timeout=60)
            exited[k] = time.time()
            log = open(tmp_path / f"{k}.log").read()
            if mode == "kill":
                assert procs[k].returncode == 3, (
                    log
                )  # its own code: no SIGABRT from JAX's coordination service
                lost_after = float(
                    re.search(r"lost ([0-9.]+)s after the peer went away", log).group(1)
                )
                assert LOST_GRACE_SECS <= lost_after < LOST_GRACE_SECS + 8, (
                    log
                )  # the grace: a peer may leave as its barrier returns
                assert f"process {last} of the job" in log and "went away" in log, log
                assert f"stopped waiting for process {last} at the barrier" in log, log
            else:
                assert procs[k].returncode == 0, log
                assert "wait ended" in log and "gone: None" in log, log
        assert time.monotonic() - started < 25  # (not JAX's 30 s heartbeat timeout)
        if mode == "kill":  # process 0, where the coordination service runs, went after the others
            log0 = open(tmp_path / "0.log").read()
            assert "exiting while other processes" not in log0, log0
            for k in range(1, last):
                left = re.search(r"exiting at ([0-9.]+)", open(tmp_path / f"{k}.log").read())
                assert float(left.group(1)) <= exited[0] < float(left.group(1)) + 10, exited
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
