"""Evaluation: exact aggregation, durable records, statuses, across restarts."""

import jax
import numpy as np
import pytest
from pydantic import ValidationError

from prefect_jax.examples.digits import DigitsProgram, load_digits_split
from prefect_jax.training.evaluation import EvalResult, EvalStatus
from prefect_jax.training.trainer import Trainer


def _tiny(**kw):
    return DigitsProgram(**{"hidden": (32, 32), "learning_rate": 3e-3, "batch_size": 32, **kw})


def test_metrics_are_exact_over_uneven_batches(job_config):
    program = _tiny(eval_batch_size=100)  # 359 eval examples: batches of 100, 100, 100, 59
    trainer = Trainer(job_config(), program=program)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    result = trainer.evaluate_if_new()
    _, _, x, y = load_digits_split()
    logits = np.asarray(program.apply(trainer.state["params"], x))
    assert result.status is EvalStatus.EVALUATED
    assert result.num_batches == 4 and result.num_examples == 359
    assert result.metrics["accuracy"] == pytest.approx(
        float((logits.argmax(-1) == y).mean()), abs=1e-7
    )
    expected_loss = float(np.mean(-jax.nn.log_softmax(logits)[np.arange(len(y)), y]))
    assert result.metrics["loss"] == pytest.approx(expected_loss, rel=1e-5)


def test_eval_steps_limits_the_batches(job_config):
    trainer = Trainer(job_config(eval_steps=2), program=_tiny(eval_batch_size=100))
    trainer.restore_or_init()
    result = trainer.evaluate_if_new(0)
    assert result.num_batches == 2 and result.num_examples == 200


def test_each_step_is_evaluated_once_across_restarts(job_config):
    config = job_config(max_steps=40)
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    first = trainer.evaluate_if_new()
    assert first.status is EvalStatus.EVALUATED and first.step == 20
    again = trainer.evaluate_if_new()
    assert again.status is EvalStatus.NO_NEW_CHECKPOINT and again.metrics == first.metrics
    trainer.job.checkpoints.wait()
    trainer.close()

    restarted = Trainer(config)
    assert restarted.restore_or_init() == 20
    assert restarted.evaluate_if_new().status is EvalStatus.NO_NEW_CHECKPOINT
    assert restarted.job.records.steps() == [20]
    history = restarted.job.tracker.metric_history("eval/accuracy")
    assert history == [(20, first.metrics["accuracy"])]


def test_missing_checkpoint_status(job_config):
    trainer = Trainer(job_config())
    result = trainer.evaluate_if_new()
    assert result.status is EvalStatus.MISSING_CHECKPOINT


def test_evaluating_a_committed_step_from_storage(job_config):
    config = job_config(max_steps=40)
    writer = Trainer(config)
    writer.restore_or_init()
    writer.train_until_checkpoint()
    writer.job.checkpoints.wait()
    reader = Trainer(
        config.model_copy(update={"eval": config.eval.model_copy(update={"name": "other"})})
    )
    result = reader.evaluate_if_new()  # no live state: restores the newest committed step
    assert result.status is EvalStatus.EVALUATED and result.step == 20 and result.name == "other"
    assert reader.state is None


def test_throttle_skips_but_never_the_final_step(job_config):
    config = job_config(max_steps=40)
    config = config.model_copy(
        update={"eval": config.eval.model_copy(update={"throttle_secs": 3600})}
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    assert trainer.evaluate_if_new().status is EvalStatus.EVALUATED
    assert trainer.evaluate_if_new().status is EvalStatus.NO_NEW_CHECKPOINT
    trainer.train_until_checkpoint()
    final = trainer.evaluate_if_new()
    assert final.status is EvalStatus.EVALUATED and final.is_final and final.step == 40


def test_local_mode_throttles_from_the_start_of_the_last_evaluation_as_tfs(job_config):
    """TF's "the last evaluation was started at least this many seconds ago": the time an
    evaluation takes counts, so a slow evaluation does not throttle the next one as well."""
    from prefect_jax.training.evaluation import throttled

    trainer = Trainer(job_config(max_steps=40))
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    result = trainer.evaluate_if_new()
    assert result.started_at <= result.evaluated_at
    trainer.finish()
    records = trainer.job.records
    slow = result.model_copy(update={"step": 21, "started_at": 100.0, "evaluated_at": 130.0})
    records.put(slow)  # began at 100 s, took 30 s
    assert throttled(records, 40.0, now=lambda: 139.0)
    assert not throttled(records, 40.0, now=lambda: 141.0)  # (130 + 40 would wait to 170)
    # a record written before the start was kept counts from its end
    records.put(slow.model_copy(update={"step": 22, "started_at": None}))
    assert throttled(records, 40.0, now=lambda: 141.0)


def test_eval_result_validation():
    with pytest.raises(ValidationError, match="needs the global step"):
        EvalResult(status=EvalStatus.EVALUATED, metrics={"a": 1.0})
    with pytest.raises(ValidationError, match="has no metrics"):
        EvalResult(status=EvalStatus.EVALUATED, step=3, metrics={})
    assert EvalResult(status=EvalStatus.NO_NEW_CHECKPOINT).step is None


def test_eval_step_must_return_sum_count_pairs(job_config):
    class NoCounts(DigitsProgram):
        def eval_step(self, state, batch):
            return {"accuracy": batch["y"].sum()}

    trainer = Trainer(job_config(), program=NoCounts(hidden=(32, 32)))
    trainer.restore_or_init()
    with pytest.raises(ValueError, match=r"must be a \(sum, count\) pair"):
        trainer.evaluate_if_new(0)


def test_the_live_steps_evaluation_is_recorded_once_it_commits_while_training_goes_on(
    job_config, monkeypatch
):
    """The evaluation of the live step does not hold training for its save's commit (on a GPU
    that wait was a large share of every interval, issue 13): it returns at once, pending, and
    the step is recorded (records, MLflow, `on_recorded`) once it commits, by the next interval's
    training loop, and not before."""
    import inspect

    from conftest import hold_commit, release_commit_at

    from prefect_jax.training.progress import add_progress_listener

    commit = hold_commit(monkeypatch, 100)
    trainer = Trainer(job_config(max_steps=200, every_steps=100))
    recorded = []

    def on_recorded(result):
        in_loop = any(
            f.function == "run" and f.filename.endswith("loop.py") for f in inspect.stack()
        )
        recorded.append(
            (result, in_loop, commit.is_set(), result.step in trainer.committed_steps())
        )

    # 30 dispatches into the next interval, each of which found the
    # save in flight: it may commit now.
    at_log_step = release_commit_at(trainer, commit, 130)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    result = trainer.evaluate_if_new(
        on_recorded=on_recorded
    )  # (waiting for the commit here would hang for 60 s)
    assert result.status is EvalStatus.EVALUATED and result.step == 100 and result.pending_commit
    assert trainer.job.records.steps() == [] and recorded == []
    assert 100 not in trainer.committed_steps()

    remove = add_progress_listener(at_log_step)
    try:
        # to 200: step 100 is recorded from the first dispatch after its commit
        trainer.train_until_checkpoint()
    finally:
        remove()
    # Recorded once, from the loop, after the commit (not while the
    # save was in flight), as evaluated.
    assert [(r.step, r.pending_commit, *rest) for r, *rest in recorded] == [
        (100, False, True, True, True)
    ]
    assert recorded[0][0].metrics == result.metrics
    assert trainer.job.records.get(100).metrics == result.metrics
    final = trainer.evaluate_if_new(
        on_recorded=on_recorded
    )  # the final step: recorded before it returns
    assert (
        final.step == 200
        and not final.pending_commit
        and [r.step for r, *_ in recorded] == [100, 200]
    )
    trainer.finish()
    history = trainer.job.tracker.metric_history("eval/accuracy")
    assert [s for s, _ in history] == [100, 200]


def test_a_record_made_from_the_training_loop_is_evaluation_time_in_the_goodput_ledger(
    job_config, monkeypatch
):
    """The live step's evaluation recorded later, from the next interval's training loop: the
    record's time goes to the ledger's evaluation time (MLflow's `goodput/*` metrics, the goodput
    artifact), not to training time."""
    import time

    from conftest import hold_commit, release_commit_at

    from prefect_jax.training.progress import add_progress_listener

    commit = hold_commit(monkeypatch, 100)
    trainer = Trainer(job_config(max_steps=200, every_steps=100))
    at_log_step = release_commit_at(trainer, commit, 130)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    assert trainer.evaluate_if_new(
        on_recorded=lambda result: time.sleep(0.5)
    ).pending_commit  # a slow record
    seconds = trainer.job.goodput.attempt["seconds"]
    before = {phase: seconds.get(phase, 0.0) for phase in ("train", "eval")}
    remove = add_progress_listener(at_log_step)
    try:
        started = time.perf_counter()
        trainer.train_until_checkpoint()  # step 100 recorded from its loop
        took = time.perf_counter() - started
    finally:
        remove()
    assert trainer.job.records.steps() == [100]
    assert seconds["eval"] - before["eval"] >= 0.5
    assert seconds["train"] - before["train"] <= took - 0.5  # (not counted twice)
    trainer.finish()


KILLED_BEFORE_THE_COMMIT = """
import sys, threading
from prefect_jax.training.checkpoints import Checkpoints
from prefect_jax.training.specs import JobConfig
from prefect_jax.training.trainer import Trainer
# No commit before the kill.
Checkpoints._checksum_step_in_flight = lambda self: threading.Event().wait()
trainer = Trainer(JobConfig.model_validate_json(sys.argv[1]))
trainer.restore_or_init()
trainer.train_until_checkpoint()
result = trainer.evaluate_if_new()
print("evaluated", result.step, result.pending_commit, flush=True)
threading.Event().wait()
"""


def test_a_process_killed_before_the_evaluated_step_commits_leaves_no_record_of_it(
    job_config, tmp_path
):
    """SIGKILL after the live step's evaluation returned, before its save committed: nothing says
    the step was evaluated (records, MLflow); the rerun trains it again and evaluates it once."""
    import subprocess
    import sys
    import threading

    from process_helpers import TESTS_DIR

    config = job_config(max_steps=40, every_steps=20)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_BEFORE_THE_COMMIT, config.model_dump_json()],
        cwd=TESTS_DIR,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "killed.log", "w"),
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    try:
        reader.join(timeout=180)  # (an evaluation that waited for the commit would never print)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    line = lines[0] if lines else "(nothing within 180 s)"
    assert line.split() == ["evaluated", "20", "True"], (
        line,
        (tmp_path / "killed.log").read_text()[-3000:],
    )

    rerun = Trainer(config)
    assert rerun.job.records.steps() == [] and rerun.committed_steps() == []
    assert rerun.restore_or_init() == 0
    assert rerun.job.tracker.metric_history("eval/accuracy") == []
    while rerun.step < 40:
        rerun.train_until_checkpoint()
        rerun.evaluate_if_new()
    rerun.finish()
    assert rerun.job.records.steps() == [20, 40]
    assert [s for s, _ in rerun.job.tracker.metric_history("eval/accuracy")] == [20, 40]


def test_a_stop_request_is_read_once_per_ask_at_a_step_and_the_trainers_own_is_seen_at_once(
    job_config, monkeypatch
):
    """The flow asks whether to stop before each train task, and the task asks again at its start,
    at the same step: the second ask, moments later, does not read storage (a GET on object
    storage). A request made after that is read at the next ask once the moment has passed, and one
    that the trainer's own evaluation makes (an eval hook, early stopping) at once."""
    from prefect_jax.training import trainer as trainer_module

    class StopAtOnce:
        def should_stop_job(self, result):
            return True

    trainer = Trainer(job_config(max_steps=60, every_steps=20))
    try:
        trainer.restore_or_init()
        reads = []
        real = trainer.job.stop_requested
        monkeypatch.setattr(
            trainer.job, "stop_requested", lambda: reads.append(trainer.step) or real()
        )
        assert trainer.stop_requested() is None and trainer.stop_requested() is None
        assert reads == [0]
        trainer.job.request_stop(
            "a person asked", 0, by="test"
        )  # (another process, as `prefect-jax stop` is)
        monkeypatch.setattr(trainer_module, "STOP_ANSWER_SECS", 0.0)  # (the moment has passed)
        assert trainer.stop_requested()["reason"] == "a person asked" and reads == [0, 0]
        trainer.job.storage.fs.rm(trainer.job.storage.path("stop.json"))

        monkeypatch.setattr(trainer_module, "STOP_ANSWER_SECS", 60.0)
        trainer.train_until_checkpoint()
        assert trainer.stop_requested() is None and reads == [0, 0, 20]
        trainer.eval_hooks = [StopAtOnce()]
        result = trainer.evaluate_if_new()
        assert result.status is EvalStatus.EVALUATED and result.stop_reason
        assert trainer.stop_requested()["reason"] == result.stop_reason and reads == [0, 0, 20, 20]
    finally:
        trainer.close()


def test_a_tf_listener_whose_before_eval_answers_false_stops_the_trainers_evaluations(job_config):
    """TF's `_ContinuousEvalListener.before_eval`: False skips the evaluation and ends the
    continuous evaluation; TF's takes no argument, and one that takes the step gets it."""

    class TFShaped:  # as in TF: before_eval(self)
        def __init__(self):
            self.asked = 0

        def before_eval(self):
            self.asked += 1
            return self.asked < 2

    class WithStep:
        def __init__(self):
            self.seen = []

        def before_eval(self, step):
            self.seen.append(step)
            return True

    trainer = Trainer(job_config(max_steps=60))
    try:
        tf_shaped, with_step = TFShaped(), WithStep()
        trainer.eval_hooks = [with_step, tf_shaped]
        trainer.restore_or_init()
        trainer.train_until_checkpoint()
        assert trainer.evaluate_if_new().status is EvalStatus.EVALUATED
        trainer.train_until_checkpoint()
        stopped = trainer.evaluate_if_new()
        assert stopped.status is EvalStatus.EVALUATION_STOPPED and stopped.step == 40
        assert stopped.evaluation_stopped == (
            "eval listener TFShaped.before_eval returned False before step 40: no more "
            "evaluations (TF's _ContinuousEvalListener; return True to keep evaluating)"
        )
        trainer.train_until_checkpoint()  # training goes on; the final step is not evaluated
        final = trainer.evaluate_if_new()
        assert final.status is EvalStatus.EVALUATION_STOPPED and final.step == 60
        assert tf_shaped.asked == 2 and with_step.seen == [20, 40]
        assert trainer.job.records.steps() == [20]
        assert trainer.job.stop_requested() is None  # the job was not asked to stop
    finally:
        trainer.close()


def test_eval_hooks_by_import_path_are_made_from_a_class_and_refused_with_the_fix():
    from programs import StopAfterTwo

    from prefect_jax.training.control import load_hooks
    from prefect_jax.training.program import ProgramError

    (hook,) = load_hooks(["programs:StopAfterTwo"])
    assert isinstance(hook, StopAfterTwo) and hook.evaluations == 0
    with pytest.raises(
        ProgramError,
        match=r"eval hook 'programs:TwoArgumentListener': before_eval takes 2 required "
        r"positional arguments \(at most 2\); define it as before_eval\(\) or "
        r"before_eval\(step\)",
    ):
        load_hooks(["programs:TwoArgumentListener"])
    with pytest.raises(ProgramError, match=r"eval hook 'builtins:dict' defines none of"):
        load_hooks(["builtins:dict"])


def test_the_evaluators_start_delay_and_throttle_come_from_the_eval_spec_as_tfs(job_config):
    """TF's evaluator (`run_evaluator`): it waits `start_delay_secs` before its first evaluation,
    and starts an evaluation no sooner than `throttle_secs` after the last one started (the time
    an evaluation takes counts). The final step is not throttled (prefect-jax's). The `evaluate`
    flow builds its evaluator with `Evaluator.for_job` from the job's `EvalSpec`, as here, on a
    fake clock."""
    from prefect_jax.training.evaluator import Evaluator

    config = job_config(max_steps=60)
    config = config.model_copy(
        update={
            "eval": config.eval.model_copy(update={"start_delay_secs": 120, "throttle_secs": 600})
        }
    )
    writer = Trainer(config)
    try:
        writer.restore_or_init()
        while writer.step < 60:
            writer.train_until_checkpoint()
        writer.job.checkpoints.wait()
    finally:
        writer.close()

    now, sleeps, asked = [0.0], [], []

    def sleep(secs):
        sleeps.append(secs)
        now[0] += secs

    reader = Trainer(config)
    try:

        def evaluate(step):  # the flow's: evaluate_if_new(config, step, force=True)
            asked.append((step, now[0]))
            now[0] += 5.0  # the evaluation takes time on the clock
            return reader.evaluate_if_new(step, force=True)

        evaluator = Evaluator.for_job(
            config, evaluate, clock=lambda: now[0], sleep=sleep, poll_secs=1.0
        )
        assert evaluator.wait_for_first_checkpoint() == 60
        assert sleeps == [120]  # before it looks for a checkpoint
        assert evaluator.run() == "evaluated the final step (60 >= max_steps=60)"
        assert asked == [(20, 120.0), (40, 720.0), (60, 725.0)]
        assert sleeps == [120, 595.0]
        assert reader.job.records.steps() == [20, 40, 60]
    finally:
        reader.close()


def test_a_pending_evaluation_is_recorded_once_by_the_trainer_or_an_ending_beside_it():
    """A notice's ending may run beside the trainer's call (`prefect_jax.tasks.notices`): both
    may record the evaluation waiting for its step's commit; one does, the other finds none."""
    import contextlib
    import threading
    from types import SimpleNamespace

    from prefect_jax.training.evaluation import EvalResult, EvalStatus
    from prefect_jax.training.pending import PendingEvaluation

    in_wait, go_on = threading.Event(), threading.Event()

    def wait_committed():  # the trainer's thread waits for the commit; the ending's does not
        if threading.current_thread() is not threading.main_thread():
            in_wait.set()
            go_on.wait(10)

    ledger = SimpleNamespace(phase=lambda name: contextlib.nullcontext(), add=lambda *a: None)
    job = SimpleNamespace(
        wait_committed=wait_committed, is_committed=lambda s: True, goodput=ledger
    )
    recorded: list[int] = []
    pending = PendingEvaluation(job, lambda r, on: recorded.append(r.step) or r)
    pending.hold(EvalResult(status=EvalStatus.EVALUATED, step=20, metrics={"loss": 1.0}), None)

    trainers_outcome: list = []

    def trainers_record():
        try:
            trainers_outcome.append(pending.record(wait=True))
        except Exception as exc:  # noqa: BLE001 - asserted below
            trainers_outcome.append(exc)

    trainers = threading.Thread(target=trainers_record)
    trainers.start()
    assert in_wait.wait(10)
    assert pending.record(wait=True).step == 20  # the ending, while the trainer's thread waits
    go_on.set()
    trainers.join(10)
    assert not trainers.is_alive() and trainers_outcome == [None]  # it found none to record
    assert recorded == [20] and pending.held is None


def test_every_status_but_evaluated_is_said_in_words_by_the_evaluate_task():
    """``eval of step 124: PREEMPTION_CHECKPOINT`` read as an error to a Keras user: each status
    the task logs has its meaning beside it, a status added later too."""
    from prefect_jax.tasks.evaluate import _NOT_EVALUATED
    from prefect_jax.training.evaluation import EvalStatus

    assert set(_NOT_EVALUATED) == {s.value for s in EvalStatus} - {"EVALUATED"}
