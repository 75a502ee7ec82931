"""The goodput ledger: each attempt's time by phase, what the next attempt keeps, the summary.

The kill-and-rerun path (real processes, MLflow, the Prefect artifact) is in test_preemption.
"""

import json
import os
import random

import pytest

from prefect_jax.training.goodput import _bounded, process_start_time
from prefect_jax.training.goodput_summary import as_rows, describe, mlflow_metrics, summarize
from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec
from prefect_jax.training.trainer import Trainer


def _attempt(start, updated, from_step, step, tail, ended, **seconds):
    return {
        "host": "h",
        "pid": 1,
        "process_start": start,
        "updated": updated,
        "from_step": from_step,
        "step": step,
        "tail": tail,
        "ended": ended,
        "seconds": seconds,
    }


def test_summary_splits_kept_and_recomputed_steps_and_counts_the_gaps():
    ledger = {
        "attempts": [
            # Trained 0 -> 300 (saves at 100, 200, 300) in 30 s of train
            # time, killed after its last record.
            _attempt(
                1000.0,
                1050.0,
                0,
                300,
                [[0, 0.0], [100, 10.0], [200, 20.0], [300, 30.0]],
                None,
                startup=5.0,
                restore=2.0,
                compile=3.0,
                train=30.0,
                checkpoint=1.0,
                eval=2.0,
            ),
            # Restored 200 (300 never committed): 10 s of its predecessor's training were lost.
            # It started 4 s after its predecessor's last record; finished 200 -> 400.
            _attempt(
                1054.0,
                1090.0,
                200,
                400,
                [[200, 0.0], [400, 20.0]],
                "finished",
                startup=5.0,
                restore=1.0,
                compile=1.0,
                train=20.0,
                checkpoint=1.0,
                eval=2.0,
            ),
        ]
    }
    s = summarize(ledger)
    assert s["wall_s"] == pytest.approx(90.0)
    assert s["productive_s"] == pytest.approx(20.0 + 20.0)
    assert s["goodput"] == pytest.approx(40.0 / 90.0)
    lost = s["lost_s"]
    assert lost["recomputed"] == pytest.approx(10.0)
    assert lost["between_attempts"] == pytest.approx(4.0)
    assert lost["startup"] == 10.0 and lost["restore"] == 3.0 and lost["compile"] == 4.0
    assert lost["checkpoint"] == 2.0 and lost["eval"] == 4.0
    assert lost["other"] == pytest.approx(
        (50 - 43) + (36 - 30)
    )  # each attempt's time outside the phases
    # Every second of the wall is either productive or lost for a named cause.
    assert s["productive_s"] + sum(lost.values()) == pytest.approx(s["wall_s"])
    assert (s["attempts"], s["interrupted"], s["steps"]) == (2, 1, [0, 400])
    # Steps 200-300 were trained twice: said in steps too (the UI probe's team lead found only
    # "0.17 s" of recomputed time).
    assert s["recomputed_steps"] == 100
    rows = {r["what"]: r["seconds"] for r in as_rows(s)}
    assert rows["recomputed steps (trained, then lost): 100 steps or more"] == 10.0
    assert "recomputed 10.0s (100 steps or more)" in describe(s), describe(s)
    assert sum(r["seconds"] for r in as_rows(s)) == pytest.approx(90.0, abs=0.1)
    assert dict((k, v) for k, v, _ in mlflow_metrics(s, 400))[
        "goodput/lost_s/recomputed"
    ] == pytest.approx(10.0)
    assert describe(s).startswith("44.4% of 90.0s wall") and "1 interrupted" in describe(s)
    assert summarize({}) == {} and describe({}) == "no attempt recorded"


def test_a_rerun_that_restores_an_older_step_than_any_recorded_counts_its_predecessor_as_lost():
    ledger = {
        "attempts": [
            _attempt(0.0, 10.0, 100, 300, [[200, 5.0], [300, 8.0]], None, train=8.0),
            _attempt(11.0, 20.0, 100, 200, [[100, 0.0], [200, 6.0]], "finished", train=6.0),
        ]
    }
    s = summarize(ledger)
    assert s["lost_s"]["recomputed"] == pytest.approx(8.0) and s["productive_s"] == pytest.approx(
        6.0
    )


def test_a_finished_job_is_not_waiting_and_a_rerun_that_trains_nothing_is_left_out():
    ledger = {
        "attempts": [
            _attempt(0.0, 10.0, 0, 100, [[0, 0.0], [100, 8.0]], "finished", startup=1.0, train=8.0),
            # Rerun from the UI an hour later: restored 100, trained nothing, finished (twice).
            _attempt(3600.0, 3605.0, 100, 100, [[100, 0.0]], "finished", startup=4.0, restore=1.0),
            _attempt(3700.0, 3704.0, 100, 100, [[100, 0.0]], "finished", startup=4.0),
        ]
    }
    alone = summarize({"attempts": ledger["attempts"][:1]})
    assert (
        summarize(ledger) == alone
        and alone["wall_s"] == 10.0
        and alone["goodput"] == pytest.approx(0.8)
    )
    # A day later max_steps is raised: the new attempt's own time counts, the day between does not.
    ledger["attempts"].append(
        _attempt(90000.0, 90012.0, 100, 200, [[100, 0.0], [200, 9.0]], None, startup=2.0, train=9.0)
    )
    s = summarize(ledger)
    assert s["wall_s"] == pytest.approx(10.0 + 12.0) and s["productive_s"] == pytest.approx(17.0)
    assert s["lost_s"]["between_attempts"] == 0.0 and s["lost_s"]["startup"] == 3.0
    assert s["productive_s"] + sum(s["lost_s"].values()) == pytest.approx(s["wall_s"])
    assert (s["attempts"], s["interrupted"], s["steps"]) == (
        2,
        0,
        [0, 200],
    )  # the newest, still running, is not interrupted


def _history(rng: random.Random, n: int) -> list[dict]:
    """A job's attempts over weeks: killed (SIGKILL: no end written, a gap to the rerun) and
    preempted ones, the rerun sometimes restoring an older step than the newest it recorded (a
    torn save), finishes followed by idle days, reruns of the finished job that train nothing
    (a schedule, the UI) and larger max_steps."""
    attempts, t, step, goal = [], 0.0, 0, 300
    for _ in range(n):
        start = t + rng.uniform(0.5, 5.0)
        if step >= goal:
            start += rng.uniform(1e3, 1e5)
            if rng.random() < 0.6:
                attempts.append(
                    _attempt(
                        start,
                        start + 3.0,
                        step,
                        step,
                        [[step, 0.0]],
                        "finished",
                        startup=2.0,
                        restore=0.5,
                    )
                )
                t = attempts[-1]["updated"]
                continue
            goal += 300
        train, tail, s = 0.0, [[step, 0.0]], step
        saves = rng.randint(0, 3)
        for _ in range(saves):
            s, train = min(goal, s + 100), train + rng.uniform(5.0, 10.0)
            tail.append([s, train])
        ended = "finished" if s >= goal else rng.choice([None, "preempted"])
        secs = {
            "startup": rng.uniform(1.0, 4.0),
            "restore": 0.5,
            "compile": 0.3,
            "train": train,
            "checkpoint": 0.1 * saves,
        }
        updated = start + sum(secs.values()) + rng.uniform(0.0, 1.0)
        attempts.append(_attempt(start, updated, step, s, tail[-8:], ended, **secs))
        step = tail[-2][0] if ended != "finished" and saves >= 2 and rng.random() < 0.3 else s
        t = updated + (rng.uniform(0.0, 20.0) if ended is None else 0.0)
    return attempts


@pytest.mark.parametrize("seed", range(6))
def test_folding_old_attempts_keeps_the_file_small_and_the_summary_as_it_was(seed):
    """A ledger past its size folds its oldest attempts into one entry (dropping the reruns that
    trained nothing first): the summary must not change, idle days after a finish included."""
    attempts = _history(random.Random(seed), 60)
    whole = summarize({"attempts": attempts})
    assert whole["productive_s"] + sum(whole["lost_s"].values()) == pytest.approx(
        whole["wall_s"], abs=0.01
    )  # lost_s is rounded
    for limit in (2, 3, 5, 9, 20):
        kept: list[dict] = []
        for a in attempts:  # each attempt rewrites the file from the one it read
            kept = json.loads(json.dumps(_bounded(kept + [a], limit)))
            assert len(kept) <= limit
        folded = summarize({"attempts": kept})
        assert folded.keys() == whole.keys()
        for key in ("goodput", "wall_s", "productive_s"):
            assert folded[key] == pytest.approx(whole[key]), (limit, key)
        assert folded["lost_s"] == pytest.approx(whole["lost_s"], abs=1e-6), limit
        assert (folded["attempts"], folded["interrupted"], folded["steps"]) == (
            whole["attempts"],
            whole["interrupted"],
            whole["steps"],
        )
        assert folded["recomputed_steps"] == whole["recomputed_steps"], limit


def test_process_start_time_is_this_process_to_the_tick():
    import time

    import psutil

    start = process_start_time()
    assert start <= time.time()
    assert (
        abs(start - psutil.Process(os.getpid()).create_time()) < 1.5
    )  # psutil's is whole boot seconds off


def test_the_engine_accounts_every_phase_of_an_attempt_and_a_rerun_continues_the_ledger(
    tmp_path, mlflow_uri
):
    def config(max_steps):
        return JobConfig(
            program="prefect_jax.examples.digits:tiny",
            job="gp",
            storage=str(tmp_path),
            train=TrainSpec(max_steps=max_steps),
            checkpoint=CheckpointSpec(every_steps=20),
            mlflow_tracking_uri=mlflow_uri,
        )

    trainer = Trainer(config(40))
    trainer.restore_or_init()
    while trainer.step < 40:
        trainer.train_until_checkpoint()
        trainer.evaluate_if_new()
    trainer.finish()
    run_id = trainer.job.tracker.run_id
    trainer.close()
    with open(tmp_path / "gp" / "goodput.json") as f:
        (attempt,) = json.load(f)["attempts"]
    assert attempt["ended"] == "finished" and (attempt["from_step"], attempt["step"]) == (0, 40)
    assert [s for s, _ in attempt["tail"]] == [0, 20, 40]
    assert set(attempt["seconds"]) == {
        "startup",
        "restore",
        "compile",
        "train",
        "checkpoint",
        "eval",
    }
    assert all(v >= 0 for v in attempt["seconds"].values())
    assert sum(attempt["seconds"].values()) <= attempt["updated"] - attempt["process_start"] + 1e-6

    # The same process training on (as a notebook would) is a second attempt, counted from when
    # its trainer was made (not from the process start again: no second counted twice).
    trainer = Trainer(config(60))
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.finish()
    trainer.close()
    summary = trainer.goodput()
    assert (
        summary["attempts"] == 2 and summary["interrupted"] == 0 and summary["steps"] == [0, 60]
    ), summary
    # Run again with nothing left to train: the account does not change (no attempt, no wall added).
    trainer = Trainer(config(60))
    assert trainer.restore_or_init() == 60
    trainer.finish()
    trainer.close()
    with open(tmp_path / "gp" / "goodput.json") as f:
        assert (
            len(json.load(f)["attempts"]) == 3
        )  # the ledger keeps every attempt; the summary leaves it out
    assert trainer.goodput() == summary
    assert summary["productive_s"] + sum(summary["lost_s"].values()) == pytest.approx(
        summary["wall_s"], rel=0.01
    )
    assert 0 < summary["goodput"] < 1
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(mlflow_uri).get_run(run_id).data.metrics
    assert (
        metrics["goodput/goodput"] == pytest.approx(summary["goodput"])
        and metrics["goodput/attempts"] == 2
    )


def test_an_interrupted_runs_goodput_artifact_says_how_it_ended_and_never_holds_up_its_exit(
    job_config, prefect_server, monkeypatch
):
    """The on_crashed hook's artifact names the signal that stopped the run (none: "interrupted",
    as Ctrl-C or a crash), goes to that flow run, and gives up after PREEMPTED_ARTIFACT_SECS when
    the API does not answer: a preempted machine's exit must not wait on it."""
    import signal
    import socket
    import time

    from prefect import flow, get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort
    from prefect.settings import PREFECT_API_URL, PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

    from prefect_jax.flows import hooks as flows
    from prefect_jax.tasks.publish import job_artifact_key

    config = job_config(max_steps=20, every_steps=20, job="hk")
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.finish("KILLED")  # as the hook's finish_live does: the attempt ends "preempted"

    @flow
    def crashed_run():
        pass

    flow_run_id = crashed_run(return_state=True).state_details.flow_run_id

    def published():
        with get_client(sync_client=True) as client:
            return client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    key=ArtifactFilterKey(any_=[job_artifact_key("hk", config.storage, "goodput")])
                ),
                sort=ArtifactSort.CREATED_DESC,
            )

    flows._publish_preempted_goodput(config, trainer, flow_run_id, None)
    artifacts = published()
    assert [a.flow_run_id for a in artifacts] == [flow_run_id]
    assert artifacts[0].description.startswith(
        "This run was interrupted (its newest checkpoint is step 20)"
    )
    # Published again for the same run (it was started twice): one artifact, the newer word.
    flows._publish_preempted_goodput(config, trainer, flow_run_id, signal.SIGINT)
    artifacts = published()
    assert [a.flow_run_id for a in artifacts] == [flow_run_id]
    assert artifacts[0].description.startswith(
        "This run was stopped by SIGINT after step 20: a rerun resumes"
    )
    assert "1 attempt(s), 1 of them interrupted" in artifacts[0].description

    # An API that accepts connections and never answers (Prefect's client would wait 60 s a try).
    monkeypatch.setattr(flows, "PREEMPTED_ARTIFACT_SECS", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/api"
        with temporary_settings({PREFECT_API_URL: url, PREFECT_LOGGING_TO_API_ENABLED: False}):
            started = time.monotonic()
            flows._publish_preempted_goodput(config, trainer, flow_run_id, signal.SIGTERM)
            assert time.monotonic() - started < 10
    trainer.close()


def _life(start, end_record, ended, saves, save_s, dead=2.0):
    """An attempt that started at `start`, wrote its last record at `end_record`, spent `dead` s in
    start-up, restore and compile, and `save_s` s blocked by its `saves` timed saves."""
    return {
        **_attempt(
            start, end_record, 0, 0, [], ended, startup=dead / 2, restore=dead / 4, compile=dead / 4
        ),
        "saves": saves,
        "save_s": save_s,
    }


def _one_paced_interval(
    storage: str,
    job: str,
    steps: int,
    mlflow_uri: str,
    every_secs: float | None = None,
    pause_after_restore: float = 0.0,
):
    """`programs:paced` (10 ms a step at least) trained to `steps` by a `Trainer` of its own, in
    one interval unless `every_secs` ends some sooner, `pause_after_restore` seconds after its
    restore, finished: the trainer (not closed) and each of its saves' (step, monotonic time)."""
    import time

    config = JobConfig(
        program="programs:paced",
        job=job,
        storage=storage,
        train=TrainSpec(max_steps=steps),
        checkpoint=CheckpointSpec(every_steps=steps, every_secs=every_secs, keep_last=None),
        mlflow_tracking_uri=mlflow_uri,
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    time.sleep(pause_after_restore)
    saves: list[tuple[int, float]] = []
    save = trainer.job.save
    trainer.job.save = lambda step, *a, **kw: (
        saves.append((step, time.monotonic())),
        save(step, *a, **kw),
    )[1]
    if every_secs is None:  # one interval: its backups do not end it
        assert trainer.train_until_checkpoint() == steps
    while trainer.step < steps:
        before = trainer.step
        assert trainer.train_until_checkpoint() > before
    trainer.finish()
    return trainer, saves


def _first_step_waits(monkeypatch, seconds: float) -> list:
    """The first step of this process waits `seconds` for its executable, once (a slow compile
    or cache load); the list says whether it did."""
    import time

    from prefect_jax.training.compiled_steps import BackgroundCompile

    join, waited = BackgroundCompile.join_train_step, []

    def slow_compile(self):
        if not waited:
            waited.append(True)
            time.sleep(seconds)
        join(self)

    monkeypatch.setattr(BackgroundCompile, "join_train_step", slow_compile)
    return waited


def test_the_wait_for_the_train_steps_compile_does_not_count_towards_a_backup(
    tmp_path, mlflow_uri, monkeypatch
):
    """A rerun's first step waits for the train step's compile (or its cache load): seconds that
    trained nothing. Counted into the first part's clock, they made a backup due right after
    that one step (a save that keeps one step) wherever the wait was longer than the backup
    interval, as on a slow machine's restarts of the byte LM."""
    import time

    from prefect_jax.training.storage import JobStorage

    # The ledger of an attempt killed 1 s into its training, no save timed: a backup every 1 s.
    now, storage = time.time(), str(tmp_path / "storage")
    js = JobStorage(storage, "wait")
    js.write_json(
        js.path("goodput.json"), {"attempts": [_life(now - 20, now - 19, None, 0, 0.0, dead=0.0)]}
    )
    waited = _first_step_waits(monkeypatch, 2.0)
    trainer, saves = _one_paced_interval(storage, "wait", 300, mlflow_uri)  # 3+ s of training
    trainer.close()
    assert waited and trainer.loop.compile_s >= 2.0
    # The first backup after about a second of training: tens of steps, not one.
    steps = [step for step, _ in saves]
    assert steps[0] >= 10 and steps[-1] == 300, steps


def test_the_wait_for_the_train_steps_compile_does_not_count_towards_every_secs(
    tmp_path, mlflow_uri, monkeypatch
):
    """`every_secs` counts from the restore; a first step that waited longer than that for its
    compile (a real model's on a GPU: a minute) made a regular checkpoint due right after it, a
    save (and an evaluation) of one step's progress."""
    waited = _first_step_waits(monkeypatch, 2.0)
    storage = str(tmp_path / "storage")
    trainer, saves = _one_paced_interval(storage, "secs", 300, mlflow_uri, every_secs=1.0)
    trainer.close()
    assert waited and trainer.loop.compile_s >= 2.0
    # The first checkpoint after about a second of training: tens of steps, not one.
    steps = [step for step, _ in saves]
    assert steps[0] >= 10 and steps[-1] == 300, steps


def test_the_time_between_the_restore_and_the_training_does_not_count_towards_every_secs(
    tmp_path, mlflow_uri
):
    """A new job's first run waits up to a minute for its MLflow run after the restore (and a
    rerun evaluates the restored step there): counted, they made a checkpoint due after the
    first step. `every_secs` counts from the first training after the restore."""
    storage = str(tmp_path / "storage")
    trainer, saves = _one_paced_interval(
        storage, "pause", 300, mlflow_uri, every_secs=1.0, pause_after_restore=2.0
    )
    trainer.close()
    steps = [step for step, _ in saves]
    assert steps[0] >= 10 and steps[-1] == 300, steps


def test_a_collectives_error_says_whether_another_process_of_the_job_went_away():
    from prefect_jax.training.cluster import lost_a_process

    # As gloo raised it here when the other process was SIGKILLed mid all-reduce.
    gloo = ValueError(
        "UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] "
        "Read error [127.0.0.1]:5803: Connection reset by peer"
    )
    assert lost_a_process(gloo)
    try:  # found through the chain too (the task's own error wrapping the collective's)
        try:
            raise gloo
        except ValueError as inner:
            raise RuntimeError("train 200 to 400 failed") from inner
    except RuntimeError as outer:
        assert lost_a_process(outer)
    assert lost_a_process(
        RuntimeError(
            "NCCL operation ncclAllReduce failed: "
            "remote process exited or there was a network error"
        )
    )
    assert lost_a_process(
        RuntimeError(
            "UNAVAILABLE: The coordination service has stopped; "
            "task /job:jax_worker/task:1 heartbeat timeout"
        )
    )
    assert lost_a_process(
        RuntimeError(
            "UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was "
            "preempted/died/restarted unexpectedly or this task is experiencing network issues."
        )
    )
    # The program's own errors, its storage's and its lease's are not a kill.
    from prefect_jax.training.errors import LeaseHeldError

    for own in (
        ValueError("batch size 30 does not divide over 4 devices"),
        RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB"),
        RuntimeError("NCCL version mismatch"),
        RuntimeError("NCCL error: unhandled system error"),
        OSError("503 Service Unavailable"),
        BlockingIOError(11, "Resource temporarily unavailable"),
        ConnectionRefusedError(111, "Connection refused"),
        BrokenPipeError(32, "Broken pipe"),
        RuntimeError("UNAVAILABLE: failed to connect to all addresses (gcs)"),
        RuntimeError("DEADLINE_EXCEEDED: Barrier timed out"),
        LeaseHeldError("/s/job", {"pid": 1, "host": "h", "heartbeat": 0}, 120.0),
    ):
        assert not lost_a_process(own), own


def test_on_remote_storage_a_backup_waits_until_the_step_before_it_is_uploaded(
    tmp_path, mlflow_uri, monkeypatch
):
    """A backup is only worth something once it is on the remote storage (a killed spot machine
    takes its disk along): with uploads slower than the backup interval, the next backup waits
    for the upload before it instead of queueing behind it."""
    import time
    import uuid

    from prefect_jax.training.remote import RemoteSteps
    from prefect_jax.training.storage import JobStorage

    storage = f"memory://backups-{uuid.uuid4().hex[:8]}"
    # The ledger of an attempt killed 1 s into training: backups every second or so.
    now, js = time.time(), JobStorage(storage, "bk")
    js.write_json(
        js.path("goodput.json"),
        {
            "attempts": [
                _life(now - 20, now - 19, None, 1, 0.02, dead=0.0),
                _life(now - 18, now - 18, "preempted", 0, 0.0, dead=0.0),
            ]
        },
    )
    uploads: dict[int, list[float]] = {}
    upload = RemoteSteps.upload

    def slow_upload(
        self, step, local_step_dir, **kw
    ):  # 1.2 s a step: longer than the backup interval
        uploads[step] = [time.monotonic()]
        time.sleep(1.2)
        try:
            return upload(self, step, local_step_dir, **kw)
        finally:
            uploads[step].append(time.monotonic())

    monkeypatch.setattr(RemoteSteps, "upload", slow_upload)
    trainer, saves = _one_paced_interval(storage, "bk", 600, mlflow_uri)  # 6+ s of training
    remote = trainer.job.remote
    trainer.close()
    backups = [(s, t) for s, t in saves if s < 600]
    assert len(backups) >= 2, saves  # one a second, once the step before it is up: ~1.5 s apart
    for step, at in backups[1:]:
        assert all(uploads[s][1] <= at for s, _ in saves if s < step), (
            f"backup {step} was started while a step was uploading"
        )
    assert sorted(uploads) == [s for s, _ in saves]
    # Up there, a newer step supersedes every backup (retention keeps all
    # other steps here: keep_last=None).
    assert remote.committed_steps() == [600] and remote.read_meta(600)["step"] == 600
