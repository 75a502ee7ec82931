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
import threading

import pytest
from conftest import train_and_close
from mlflow.tracking import MlflowClient
from process_helpers import TESTS_DIR, cli_env, orbax_tmp_dirs, start_run, status, wait_until

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
    return [
        "--program",
        PROGRAM,
        "--job",
        job,
        "--storage",
        storage,
        "--max-steps",
        str(MAX_STEPS),
        "--checkpoint-every-steps",
        str(EVERY),
        "--log-every-steps",
        "10",
        "--keep-last",
        "10",
        "--mlflow-tracking-uri",
        mlflow_uri,
        "--json",
        "--no-progress",
    ]


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
def test_sigterm_while_prefect_creates_a_task_run_ends_terminated_not_failed(
    tmp_path, prefect_server, mlflow_uri
):
    """Prefect's crash handling fails if SIGTERM lands while it creates a task run ("Task run is
    not set"), turning a preemption into a Failed run and an error exit. The run still ends as
    terminated: exit 143, flow run Crashed (what rerun automations match), MLflow run KILLED."""
    import httpx

    storage = str(tmp_path / "storage")
    args = [
        "run",
        "--program",
        "prefect_jax.examples.digits:tiny",
        "--job",
        "in-creation",
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
        env=cli_env(prefect_server),
        cwd=TESTS_DIR,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "Task run is not set" in out, out[-3000:]  # the Prefect failure did happen
    assert proc.returncode == 143, out[-3000:]
    assert (
        "terminated by signal 15; the newest committed step is kept" in proc.stderr.splitlines()[-1]
    )
    assert status("in-creation", storage)["committed_steps"] == [20]
    (run,) = httpx.post(
        f"{prefect_server}/flow_runs/filter",
        json={"flow_runs": {"tags": {"all_": ["job:in-creation"]}}, "limit": 5},
        timeout=30,
    ).json()
    assert run["state_type"] == "CRASHED", run["state"]
    client = MlflowClient(mlflow_uri)
    (mlflow_run,) = client.search_runs(
        [client.get_experiment_by_name("prefect-jax").experiment_id],
        filter_string=f"tags.`prefect_jax.job` = '{storage}/in-creation'",
    )
    assert mlflow_run.info.status == "KILLED"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["start", "restore", "eval"])
def test_a_sigterm_whose_handler_runs_inside_a_gc_callback_still_ends_the_job(
    where, tmp_path, prefect_server, mlflow_uri
):
    """A SIGTERM handled inside a garbage-collector callback (JAX runs one at every collection),
    where Python drops the handler's exception: the fault sweep's lost notice. Before, the job
    trained on to its end and exited 0 (at `start`, `restore`), or, with the guard's forward
    dropped (`eval`), it evaluated and exported after closing its MLflow run KILLED and freeing its
    lease, then trained a step more. Now the signal is delivered again (~10 ms later; the trainer
    that handled it refuses to go on meanwhile): the job ends terminated, having trained nothing
    past the notice. ``restore`` runs the flow without the command around it, as a worker's or
    `serve`'s flow run does."""
    import httpx

    storage, job = str(tmp_path / "storage"), f"gc-{where}"
    args = [
        "--program",
        "prefect_jax.examples.digits:tiny",
        "--job",
        job,
        "--storage",
        storage,
        "--max-steps",
        "60",
        "--checkpoint-every-steps",
        "20",
        "--mlflow-tracking-uri",
        mlflow_uri,
        "--no-progress",
    ]
    proc = subprocess.run(
        [sys.executable, "sigterm_in_gc_callback.py", where, *args],
        capture_output=True,
        text=True,
        env=cli_env(prefect_server),
        cwd=TESTS_DIR,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "Exception ignored in: <function sigterm_inside_a_gc_callback" in out, out[
        -3000:
    ]  # it was dropped
    assert (
        "prefect-jax: the exception of the SIGTERM handler above was dropped where it was raised: "
        "sending SIGTERM again" in out
    )
    # The command exits 128 + 15; a flow run called bare ends as Prefect
    # ends it: by the signal itself.
    assert proc.returncode == (-signal.SIGTERM if where == "restore" else 143), out[-3000:]
    assert committed_steps(os.path.join(storage, job, "checkpoints")) == (
        [20] if where == "eval" else []
    ), out[-3000:]
    assert not os.path.exists(os.path.join(storage, job, "exports")), out[-3000:]
    runs = httpx.post(
        f"{prefect_server}/flow_runs/filter",
        json={"flow_runs": {"name": {"any_": [f"train-and-evaluate-{job}"]}}},
        timeout=30,
    ).json()
    assert [r["state_type"] for r in runs] == ([] if where == "start" else ["CRASHED"]), runs
    if where == "eval":
        client = MlflowClient(mlflow_uri)
        (mlflow_run,) = client.search_runs(
            [client.get_experiment_by_name("prefect-jax").experiment_id],
            filter_string=f"tags.`prefect_jax.job` = '{storage}/{job}'",
        )
        assert mlflow_run.info.status == "KILLED"
        assert (
            "train/loss" in mlflow_run.data.metrics
        )  # (the names are these: the check below can fail)
        assert not [k for k in mlflow_run.data.metrics if k.startswith("eval/")], (
            mlflow_run.data.metrics
        )


@pytest.fixture
def sigterm_handler(monkeypatch):
    """A SIGTERM handler for this test (raising `raises`, if set), a hook Python's dropped
    exceptions go to before prefect-jax's, and the module state a notice leaves reset afterwards:
    yields the list of what happened ("handler", "dropped <type>")."""
    import sigterm_in_gc_callback

    from prefect_jax.training import preemption

    calls: list[str] = []

    class Handler:
        raises: type[BaseException] | None = None

        def __call__(self, signum, frame):
            calls.append("handler")
            if self.raises is not None:
                raise self.raises(signum)

    handler = Handler()
    monkeypatch.setattr(preemption, "_received", None)
    monkeypatch.setattr(preemption, "_handler_codes", set(preemption._handler_codes))
    monkeypatch.setattr(preemption, "_sending", None)
    monkeypatch.setattr(sigterm_in_gc_callback, "_sent", [])
    monkeypatch.setattr(
        sys,
        "unraisablehook",
        lambda unraisable: calls.append(f"dropped {type(unraisable.exc_value).__name__}"),
    )
    before = signal.signal(signal.SIGTERM, handler)
    try:
        yield calls, handler
    finally:
        for (
            thread
        ) in threading.enumerate():  # a signal still to be sent again comes here, not to pytest
            if thread.name == preemption.RESEND_THREAD:
                thread.join(timeout=30)
        _wait_in_ordinary_code(0.05)
        signal.signal(signal.SIGTERM, before)


@pytest.fixture
def sends(monkeypatch):
    """The signals prefect-jax would send again (recorded, not sent)."""
    from prefect_jax.training import preemption

    sent: list[int] = []
    monkeypatch.setattr(
        preemption, "_send_when_set", lambda signum: (sent.append(signum), threading.Event())[1]
    )
    return sent


class Ended(Exception):
    pass


def _wait_in_ordinary_code(secs: float) -> None:
    import time

    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        time.sleep(0.001)


def test_a_guard_whose_forwarded_notice_python_drops_delivers_it_again(sigterm_handler):
    """The Python API (no command, no flow): the trainer's guard, handling a SIGTERM inside a gc
    callback, forwards it to the handler before it, whose exception Python drops; the signal is
    delivered again until the handler's exception reaches ordinary code."""
    from sigterm_in_gc_callback import sigterm_inside_a_gc_callback

    from prefect_jax.training import preemption

    calls, handler = sigterm_handler
    handler.raises = Ended
    guard = preemption.PreemptionGuard(lambda: (calls.append("on_signal"), guard.forward()))
    try:
        guard.install()
        with pytest.raises(Ended):
            sigterm_inside_a_gc_callback()
            _wait_in_ordinary_code(30)
    finally:
        guard.uninstall()
    # (A collection of this process's heap can outlast the first delivery again:
    # JAX's gc callback drops it then.)
    assert calls[:3] == ["on_signal", "handler", "dropped Ended"] and calls[3:] == [
        "handler",
        "dropped Ended",
    ] * ((len(calls) - 4) // 2) + ["handler"], calls
    assert preemption.received_signal() == signal.SIGTERM


def test_a_notice_dropped_while_an_earlier_one_is_handled_is_not_sent_again(sigterm_handler, sends):
    """A SIGTERM whose handler's exception is dropped is sent again, unless it was raised while an
    earlier one's was being handled (Prefect's crash handling, say): the first one ends the
    process, and a signal sent again would break into its handling."""
    import sigterm_in_gc_callback

    from prefect_jax.training import preemption

    calls, handler = sigterm_handler
    handler.raises = Ended
    preemption.deliver_lost_notices()
    sigterm_in_gc_callback.sigterm_inside_a_gc_callback()  # in ordinary code: sent again
    assert (calls, sends) == (["handler", "dropped Ended"], [signal.SIGTERM])
    sigterm_in_gc_callback._sent.clear()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_in_ordinary_code(30)
    except Ended:
        # while the first one is handled: not sent again
        sigterm_in_gc_callback.sigterm_inside_a_gc_callback()
    assert (calls[2:], sends) == (["handler", "handler", "dropped Ended"], [signal.SIGTERM])


def test_drops_before_the_signal_goes_again_send_it_once(sigterm_handler):
    """Two notices dropped before the first is sent again: one signal (a second would break into
    the handling of the first)."""
    from prefect_jax.training import preemption

    calls, _ = sigterm_handler
    first, second = (
        preemption._send_when_set(signal.SIGTERM),
        preemption._send_when_set(signal.SIGTERM),
    )
    assert first is second
    first.set()
    _wait_in_ordinary_code(1.0)
    assert calls == ["handler"]


def test_only_a_sigterm_handlers_dropped_exception_is_a_notice(monkeypatch, sends):
    """With no handler of its own in place (SIG_DFL: an IntEnum, whose class's call is Enum's), an
    exception dropped on its way out of an Enum lookup, or anything else, is no notice."""
    import enum

    from prefect_jax.training import preemption

    class Colour(enum.Enum):
        RED = 1

    class Finalised:
        def __del__(self):
            Colour(7)

    dropped: list[str] = []
    monkeypatch.setattr(
        sys,
        "unraisablehook",
        lambda unraisable: dropped.append(type(unraisable.exc_value).__name__),
    )
    monkeypatch.setattr(preemption, "_handler_codes", set(preemption._handler_codes))
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        preemption.deliver_lost_notices()
        Finalised()  # (dropped at once)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (dropped, sends) == (["ValueError"], [])


def test_a_signal_sent_again_whose_handler_runs_inside_the_hook_is_sent_again(
    sigterm_handler, monkeypatch, sends
):
    """The handler of a SIGTERM that comes while the hook itself runs (here: the hook before it
    raises the signal) raises inside the hook, where Python would drop it too, and then for good:
    the hook catches it and sends the signal again."""
    from prefect_jax.training import preemption

    calls, handler = sigterm_handler
    handler.raises = Ended

    def hook_that_takes_a_signal(unraisable):
        calls.append(f"dropped {type(unraisable.exc_value).__name__}")
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(sys, "unraisablehook", hook_that_takes_a_signal)
    preemption.deliver_lost_notices()

    class Finalised:
        def __del__(self):
            raise KeyError("no notice")

    Finalised()  # (dropped at once: the hook runs, and takes the SIGTERM)
    assert (calls, sends) == (["dropped KeyError", "handler"], [signal.SIGTERM])


def test_a_notice_whose_handling_fails_still_goes_on_to_the_handler_before(
    sigterm_handler, job_config, monkeypatch
):
    """The trainer's handling of a notice fails (storage gone with the node, say): the signal still
    goes on to the handler before the guard (Prefect's bridge ends the run), with the failure as
    its context, and the trainer refuses to go on. Before, the failure alone came out, the notice
    was never forwarded, and the guard, still handling it, took no later SIGTERM."""
    from prefect_jax.training.errors import Preempted

    calls, handler = sigterm_handler
    handler.raises = Ended
    trainer = Trainer(job_config(max_steps=40, every_steps=20))
    try:
        trainer.restore_or_init()
        trainer.train_until_checkpoint()
        gone = lambda *a: (_ for _ in ()).throw(OSError("storage went away"))  # noqa: E731
        monkeypatch.setattr(trainer.job, "committed_steps", gone)
        monkeypatch.setattr(trainer.job, "is_committed", gone)
        with pytest.raises(Ended) as ended:
            os.kill(os.getpid(), signal.SIGTERM)  # between tasks: the guard handles it at once
            _wait_in_ordinary_code(30)
        assert isinstance(ended.value.__context__, OSError) and calls == ["handler"], calls
        with pytest.raises(Preempted, match="preempted at step 20"):
            trainer.evaluate_if_new()
    finally:
        trainer.close()


def test_a_notice_inside_code_holding_a_lock_the_ending_needs_frees_the_lease_in_time(
    sigterm_handler, job_config, monkeypatch, mlflow_uri
):
    """The SIGTERM's handler runs wherever the main thread is: here inside code that holds a lock
    (as Prefect does while it sends an event between tasks) which the ending needs too (an
    evaluation's record publishes an event). The ending gives up on that record (run on a helper
    thread) at the grace period; the MLflow run closes KILLED, the lease is freed and the signal
    goes on in time. Before, the main thread waited on its own lock, and Prefect's runner, 30 s
    after a cancel's SIGTERM, killed the process with the lease still held
    (tests/test_deployment_cancel.py failed so in CI)."""
    import time

    from conftest import hold_commit

    calls, handler = sigterm_handler
    handler.raises = Ended
    grace = 2.0
    commit = hold_commit(monkeypatch, 20)
    event_queue = threading.Lock()  # (Prefect's: a plain lock, held while an event is queued)

    def publish(result):  # the evaluate task's `on_recorded`: it sends an event
        if event_queue.acquire(timeout=20):
            event_queue.release()

    trainer = Trainer(job_config(max_steps=40, every_steps=20, sigterm_grace_secs=grace))
    try:
        trainer.restore_or_init()
        trainer.train_until_checkpoint()
        assert trainer.evaluate_if_new(on_recorded=publish).pending_commit
        commit.set()  # step 20 commits; its evaluation is recorded as the attempt ends
        wait_until(lambda: 20 in trainer.committed_steps(), 60, "step 20 committed", poll=0.05)
        started = time.monotonic()
        with pytest.raises(Ended), event_queue:
            os.kill(os.getpid(), signal.SIGTERM)  # between tasks: the guard handles it at once
            _wait_in_ordinary_code(30)
        took = time.monotonic() - started
        assert not os.path.exists(os.path.join(trainer.job.storage.job_dir, "lease.json"))
        assert took < grace + 5, f"the signal went on {took:.1f}s after it came"
        assert 20 in trainer.committed_steps() and calls == ["handler"], calls
        # (closed from a helper thread, which may finish after the signal went on)
        client, run_id = MlflowClient(mlflow_uri), trainer.job.tracker.run_id
        wait_until(
            lambda: client.get_run(run_id).info.status == "KILLED", 30, "the run KILLED", poll=0.2
        )
    finally:
        trainer.close()


def test_a_trainer_whose_notice_went_on_to_a_handler_that_returned_does_nothing_more(
    sigterm_handler, job_config
):
    """The trainer checkpointed, closed its MLflow run KILLED and freed its lease on a SIGTERM it
    handled inside a gc callback; the handler it forwarded to returned, and its own `Preempted` was
    dropped. It then refuses to go on (an evaluation, an export, training): `Preempted` again."""
    from sigterm_in_gc_callback import sigterm_inside_a_gc_callback

    from prefect_jax.training.errors import Preempted

    calls, _ = sigterm_handler
    trainer = Trainer(job_config(max_steps=40, every_steps=20))
    try:
        trainer.restore_or_init()
        trainer.train_until_checkpoint()
        sigterm_inside_a_gc_callback()  # between tasks: the guard handles it at once
        _wait_in_ordinary_code(0.5)
        assert calls[:2] == ["handler", "dropped Preempted"], calls
        for go_on in (
            trainer.evaluate_if_new,
            trainer.train_until_checkpoint,
            trainer.restore_or_init,
        ):
            with pytest.raises(Preempted, match="preempted at step 20"):
                go_on()
        assert committed_steps(trainer.job.storage.checkpoint_dir) == [20]
    finally:
        trainer.close()


def test_a_sigterm_that_breaks_an_import_in_the_command_still_ends_it_terminated(
    sigterm_handler, monkeypatch, capsys
):
    """The command's SIGTERM handler raises SystemExit wherever the main thread is: inside a C
    extension's import (pydantic-core's, in the `start` case above on busy cores) that became
    pyo3's `PanicException`, a BaseException, and the command exited 1. It exits 143, saying so."""
    from prefect_jax import cli
    from prefect_jax.cli import commands

    class PanicException(BaseException):  # (pyo3 makes one per extension)
        pass

    def run_broken_by_a_sigterm(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the command's handler: SystemExit(143)
            _wait_in_ordinary_code(30)
        except SystemExit as exc:
            raise PanicException("failed to import `datetime` C API") from exc

    monkeypatch.setattr(commands, "cmd_run", run_broken_by_a_sigterm)
    assert (
        cli.main(["run", "--program", "programs:tiny", "--job", "broken", "--storage", "unused"])
        == 143
    )
    assert "terminated by signal 15; the newest committed step is kept" in capsys.readouterr().err


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
