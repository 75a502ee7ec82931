"""The continuous evaluator (`prefect_jax.training.evaluator.Evaluator`) alone: a fake clock, fake
storage and fake evaluations, no Prefect, no JAX training."""

import pytest

from prefect_jax.training import control
from prefect_jax.training.evaluation import EvalResult, EvalStatus
from prefect_jax.training.evaluator import Evaluator


class Clock:
    """A monotonic clock that moves only when slept on."""

    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, secs: float) -> None:
        self.sleeps.append(secs)
        self.now += secs


class Records:
    def __init__(self, results=()):
        self.results = {r.step: r for r in results}

    def steps(self) -> list[int]:
        return sorted(self.results)

    def get(self, step: int):
        return self.results.get(step)


def _evaluated(step: int, stop_reason=None) -> EvalResult:
    return EvalResult(
        status=EvalStatus.EVALUATED,
        step=step,
        metrics={"loss": 1.0 / (step + 1)},
        stop_reason=stop_reason,
    )


class Job:
    """A job's storage as the evaluator reads it: committed steps (appearing over time), records,
    backups; the evaluations it was asked for and the exports it made."""

    def __init__(self, clock, committed=(), appear=None, backups=(), statuses=None, records=()):
        self.clock, self.committed = clock, list(committed)
        self.appear = dict(appear or {})  # step -> time it is committed
        self.backups, self.statuses = set(backups), dict(statuses or {})
        self.records = Records(records)
        self.asked: list[tuple[int, float]] = []
        self.exported: list[int] = []
        self.backup_reads: list[int] = []

    def committed_steps(self) -> list[int]:
        return sorted(self.committed + [s for s, at in self.appear.items() if at <= self.clock.now])

    def is_backup(self, step: int) -> bool:
        self.backup_reads.append(step)
        return step in self.backups

    def evaluate(self, step: int) -> EvalResult:
        self.asked.append((step, self.clock.now))
        status = self.statuses.get(step, EvalStatus.EVALUATED)
        if status is EvalStatus.MISSING_CHECKPOINT:
            self.committed.remove(step)  # retention deleted it: no longer committed
        if status is not EvalStatus.EVALUATED:
            return EvalResult(status=status, step=step)
        result = _evaluated(
            step, stop_reason="no improvement" if step == self.statuses.get("stop") else None
        )
        self.records.results[step] = result
        return result

    def export(self, result: EvalResult) -> None:
        self.exported.append(result.step)


def _evaluator(job: Job, clock: Clock, **options) -> Evaluator:
    options.setdefault("max_steps", 100)
    return Evaluator(
        job="j",
        evaluate=job.evaluate,
        records=job.records,
        committed_steps=job.committed_steps,
        is_backup=job.is_backup,
        export=job.export,
        clock=clock,
        sleep=clock.sleep,
        poll_secs=5.0,
        **options,
    )


def test_it_evaluates_each_committed_step_once_until_the_final_step():
    clock = Clock()
    job = Job(clock, committed=[10], appear={20: 7.0, 100: 12.0})
    evaluator = _evaluator(job, clock)
    assert evaluator.wait_for_first_checkpoint() == 10
    stopped = evaluator.run()
    assert stopped == "evaluated the final step (100 >= max_steps=100)"
    assert job.asked == [(10, 0.0), (20, 10.0), (100, 15.0)]  # polled every 5 s
    assert job.exported == [10, 20, 100]
    assert clock.sleeps == [5.0, 5.0, 5.0]
    assert evaluator.summary() == {
        "evaluated": [10, 20, 100],
        "last_step": 100,
        "eval": {"loss": 1.0 / 101},
        "stopped": stopped,
    }


def test_it_skips_what_the_records_hold_and_only_the_newest_without_every_checkpoint():
    clock = Clock()
    job = Job(clock, committed=[10, 20, 30, 40], records=[_evaluated(10)])
    evaluator = _evaluator(job, clock, every_checkpoint=False, max_steps=40)
    assert evaluator.pending_steps() == [40]
    assert evaluator.run() == "evaluated the final step (40 >= max_steps=40)"
    assert [step for step, _ in job.asked] == [40]
    assert evaluator.evaluated == [40]


def test_backups_and_preemption_checkpoints_are_never_evaluated_and_read_once():
    clock = Clock()
    job = Job(
        clock,
        committed=[10, 15, 17, 20],
        backups=[15],
        statuses={17: EvalStatus.PREEMPTION_CHECKPOINT},
    )
    evaluator = _evaluator(job, clock, once=True)
    assert evaluator.run() == "nothing new to evaluate (once=True)"
    assert [step for step, _ in job.asked] == [10, 17, 20]
    assert evaluator.evaluated == [10, 20] and job.exported == [10, 20]
    assert evaluator.pending_steps() == []
    assert sorted(job.backup_reads) == [10, 15, 17, 20]  # each step's metadata read once


def test_the_throttle_spaces_evaluations_but_not_the_final_one():
    clock = Clock()
    job = Job(clock, committed=[10, 20, 100])
    evaluator = _evaluator(job, clock, throttle_secs=60.0)
    assert evaluator.run() == "evaluated the final step (100 >= max_steps=100)"
    assert job.asked == [(10, 0.0), (20, 60.0), (100, 60.0)]


def test_newest_only_evaluates_the_newest_step_once_the_throttle_wait_is_over():
    """TF's evaluator: the latest checkpoint when it evaluates, if new. It chose the step before
    the wait (30 at 60 s, though 40 was committed by then), and went back for older steps."""
    clock = Clock()
    job = Job(clock, committed=[10, 20], appear={30: 30.0, 40: 50.0})
    evaluator = _evaluator(job, clock, throttle_secs=60.0, every_checkpoint=False, max_steps=40)
    assert evaluator.run() == "evaluated the final step (40 >= max_steps=40)"
    assert job.asked == [(20, 0.0), (40, 60.0)]  # 30, found at 30 s, is older by then
    # Nor is an older step left behind evaluated once the newer ones are: 10 never is.
    job = Job(clock, committed=[10, 20])
    newest = _evaluator(job, clock, every_checkpoint=False, once=True)
    assert newest.run() == "nothing new to evaluate (once=True)"
    assert [step for step, _ in job.asked] == [20]


def test_the_throttle_counts_from_the_start_of_the_last_evaluation_as_tfs():
    """TF's evaluator throttle: "do not re-evaluate unless the last evaluation was started at
    least this many seconds ago": the time an evaluation takes counts toward the wait."""
    clock = Clock()
    job = Job(clock, committed=[10, 20, 30])
    slow = job.evaluate

    def evaluate(step):
        result = slow(step)
        clock.now += 15.0  # each evaluation takes 15 s
        return result

    job.evaluate = evaluate
    evaluator = _evaluator(job, clock, throttle_secs=60.0, once=True)
    assert evaluator.run() == "nothing new to evaluate (once=True)"
    assert job.asked == [(10, 0.0), (20, 60.0), (30, 120.0)]
    assert clock.sleeps == [45.0, 45.0]


def test_start_delay_secs_comes_before_the_first_evaluation_as_tfs():
    """TF's evaluator: it waits `start_delay_secs` before its first evaluation, even where a
    checkpoint is there already."""
    clock = Clock()
    job = Job(clock, committed=[10])
    evaluator = _evaluator(job, clock, start_delay_secs=120.0, once=True)
    assert evaluator.wait_for_first_checkpoint() == 10
    evaluator.run()
    assert job.asked == [(10, 120.0)] and clock.sleeps == [120.0]


def test_an_evaluator_whose_listener_stopped_evaluating_ends_after_that_export():
    """TF's `run_evaluator`: a `_ContinuousEvalListener` that answers False ends the continuous
    evaluation; the evaluation it answered after was exported first."""
    clock = Clock()
    job = Job(clock, committed=[10, 20, 30])
    plain = job.evaluate

    def evaluate(step):
        result = plain(step)
        if step == 20:  # what the trainer returns once after_eval answered False
            return result.model_copy(update={"evaluation_stopped": "listener said no"})
        return result

    job.evaluate = evaluate
    evaluator = _evaluator(job, clock)
    assert evaluator.run() == "listener said no"
    assert [step for step, _ in job.asked] == [10, 20] and job.exported == [10, 20]
    stopped = EvalResult(status=EvalStatus.EVALUATION_STOPPED, step=30, evaluation_stopped="no")
    job2 = Job(clock, committed=[30])
    job2.evaluate = lambda step: stopped  # before_eval answered False: nothing to export
    evaluator = _evaluator(job2, clock)
    assert evaluator.run() == "no" and job2.exported == [] and evaluator.evaluated == []


def test_an_early_stopping_result_or_a_stop_request_stops_it():
    clock = Clock()
    job = Job(clock, committed=[10, 20, 30], statuses={"stop": 20})
    evaluator = _evaluator(job, clock)
    assert evaluator.run() == "no improvement"
    assert [step for step, _ in job.asked] == [10, 20]

    # A stop that an evaluation asked (early stopping, by another evaluator) ends the evaluations.
    job = Job(clock, committed=[10])
    asked = {"reason": "enough", "by": control.by_evaluation("eval")}
    evaluator = _evaluator(job, clock, stop_request=lambda: asked)
    assert evaluator.run() == "the job was asked to stop: enough"
    assert job.asked == []


def test_a_stop_a_train_hook_or_a_person_asked_evaluates_the_trainers_last_checkpoint_first():
    """TF's local mode evaluates its last checkpoint at the end. A train hook (a StopAtStepHook)
    asks the job to stop at t=1; its trainer trains on to the interval's checkpoint (20, at t=12)
    and ends: the evaluator waits while it lives, evaluates 20 without the throttle's 600 s and
    exports it, then stops. The probe's evaluator stopped at once, step 20 never evaluated."""
    clock = Clock()
    job = Job(clock, committed=[10], appear={20: 12.0})
    request = {"reason": "train hook at step 14: StopAtStepHook", "by": "train hook"}
    alive = iter([True, True, False])  # at t=5 and 10 the trainer trains on; gone at 15
    evaluator = _evaluator(
        job,
        clock,
        throttle_secs=600.0,
        stop_request=lambda: request if clock.now >= 1 else None,
        trainer_alive=lambda: next(alive),
    )
    assert evaluator.run() == f"the job was asked to stop: {request['reason']}"
    assert job.asked == [(10, 0.0), (20, 15.0)] and job.exported == [10, 20]
    # Its evaluator run again finds it evaluated: it stops at once.
    again = _evaluator(job, clock, throttle_secs=600.0, stop_request=lambda: request)
    assert again.run() == f"the job was asked to stop: {request['reason']}"
    assert len(job.asked) == 2

    # `once`: what is there now, no wait; and a trainer alive for good (hung, its lease's
    # heartbeat beating) is waited for no longer than idle_timeout_secs (a review's finds).
    for options, waited in (({"once": True}, 0.0), ({"idle_timeout_secs": 12.0}, 15.0)):
        clock = Clock()
        job = Job(clock, committed=[10], appear={20: 3600.0})
        evaluator = _evaluator(
            job, clock, stop_request=lambda: request, trainer_alive=lambda: True, **options
        )
        assert evaluator.run() == f"the job was asked to stop: {request['reason']}"
        assert (job.asked, clock.now) == ([(10, waited)], waited), options


def test_the_idle_timeout_waits_for_a_live_trainer():
    clock = Clock()
    job = Job(clock, committed=[10])
    alive = iter([True, True, False])
    evaluator = _evaluator(job, clock, idle_timeout_secs=12.0, trainer_alive=lambda: next(alive))
    assert evaluator.run() == (
        "no new checkpoint for 25s, and no trainer holds the job's lease (idle_timeout_secs=12)"
    )
    # Idle from the end of step 10's evaluation (t=0): 5, 10, 15 > 12 (alive), 20 (alive),
    # 25 (gone).
    assert clock.now == 25.0 and clock.sleeps == [5.0] * 5


def test_a_trainer_is_alive_while_its_lease_is_fresh_and_its_process_here_runs(tmp_path):
    """`trainer_alive` asks what a trainer taking the lease over asks (`holder_gone`)."""
    import json
    import subprocess
    import sys
    import time

    from prefect_jax.training.evaluator import trainer_alive
    from prefect_jax.training.lease import Lease
    from prefect_jax.training.storage import JobStorage

    js = JobStorage(str(tmp_path), "j")
    assert not trainer_alive(js)  # no lease
    lease = Lease(js, timeout_secs=30.0)
    lease.acquire()
    assert trainer_alive(js)
    record = json.loads(open(lease.path).read())
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True).stdout.strip()  # fmt: skip
    for changed in ({"pid": int(dead)}, {"heartbeat": time.time() - 31}):
        with open(lease.path, "w") as f:
            json.dump({**record, **changed}, f)
        assert not trainer_alive(js), changed
    with open(lease.path, "w") as f:  # another host's: its heartbeat alone says
        json.dump({**record, "pid": int(dead), "host": "elsewhere"}, f)
    assert trainer_alive(js)


def test_no_first_checkpoint_is_a_clear_timeout_after_the_start_delay():
    clock = Clock()
    job = Job(clock)
    logged = []
    evaluator = _evaluator(
        job,
        clock,
        start_delay_secs=3.0,
        wait_for_first_checkpoint_secs=20.0,
        where="/storage/j/checkpoints",
        log=lambda msg, *a: logged.append(msg % a),
    )
    with pytest.raises(
        TimeoutError,
        match=r"no committed checkpoint of job 'j' in /storage/j/checkpoints after 20s: .* "
        r"Raise wait_for_first_checkpoint_secs \(--wait-for-first-checkpoint-secs\)",
    ):  # (the command's user has the flag, not the flow's parameter name, to raise)
        evaluator.wait_for_first_checkpoint()
    assert clock.sleeps == [3.0, 5.0, 5.0, 5.0, 5.0]
    assert logged[0] == "waiting start_delay_secs=3 before the first evaluation"


def test_no_first_checkpoint_of_a_job_with_no_folder_names_the_jobs_there(tmp_path):
    """A mistyped job name: the storage has other jobs and none of this name. The wait's start
    and its timeout say so (an evaluator started before its trainer, whose job has a folder, is
    not told)."""
    from prefect_jax.training.errors import NoFirstCheckpointError
    from prefect_jax.training.storage import JobStorage

    (tmp_path / "digits" / "checkpoints").mkdir(parents=True)
    for job, hint in (
        ("digit", f" (storage {tmp_path} has no job 'digit'; jobs there: digits): "),
        ("digits", "after 1s: "),
    ):
        clock, warned = Clock(), []
        evaluator = _evaluator(
            Job(clock),
            clock,
            wait_for_first_checkpoint_secs=1.0,
            storage=JobStorage(str(tmp_path), job),
            warn=lambda msg, *a, said=warned: said.append(msg % a),
        )
        with pytest.raises(NoFirstCheckpointError) as raised:
            evaluator.wait_for_first_checkpoint()
        assert isinstance(raised.value, TimeoutError) and hint in str(raised.value), raised.value
        # said as the wait begins too (the default wait is an hour)
        if job == "digit":
            assert len(warned) == 1 and "jobs there: digits): waiting up to 1s" in warned[0]
            assert "is --job (or the storage) mistyped?" in warned[0], warned
        else:
            assert warned == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits"]


def test_a_step_lost_to_retention_is_a_warning_and_resume_exports_the_newest_record():
    clock = Clock()
    job = Job(
        clock,
        committed=[10, 20],
        statuses={10: EvalStatus.MISSING_CHECKPOINT},
        records=[_evaluated(5)],
    )
    warned = []
    evaluator = _evaluator(job, clock, once=True, warn=lambda msg, *a: warned.append(msg % a))
    evaluator.resume_exports()
    assert job.exported == [5]
    assert evaluator.run() == "nothing new to evaluate (once=True)"
    assert warned == ["step 10 was deleted by retention before it could be evaluated"]
    assert evaluator.evaluated == [20] and job.exported == [5, 20]
