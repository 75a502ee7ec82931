"""The checkpoint policy: step boundaries, the time cadence, backups and retention, with a fake
clock and no storage (the end-to-end paths are in test_preemption and test_goodput)."""

import logging
from types import SimpleNamespace

import pytest

from prefect_jax.training.goodput_summary import LOST_PROCESS
from prefect_jax.training.policy import CheckpointPolicy, backup_interval, retained
from prefect_jax.training.specs import CheckpointSpec


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _policy(clock=None, max_steps=600, **spec) -> CheckpointPolicy:
    clock = clock or FakeClock()
    return CheckpointPolicy.from_spec(
        CheckpointSpec(**spec), max_steps, clock=clock, wall_clock=clock
    )


def test_the_policy_takes_every_knob_from_the_spec():
    spec = CheckpointSpec(
        every_steps=50,
        every_secs=30.0,
        keep_last=2,
        keep_every_steps=100,
        keep_until_evaluated=True,
        backups=False,
        keep_every_secs=3600.0,
    )
    policy = CheckpointPolicy.from_spec(spec, 400)
    assert policy.keep_every_secs == 3600.0
    assert (policy.every_steps, policy.every_secs, policy.max_steps) == (50, 30.0, 400)
    assert (policy.keep_last, policy.keep_every_steps, policy.keep_until_evaluated) == (
        2,
        100,
        True,
    )
    assert policy.backups is False
    default = CheckpointPolicy.from_spec(None)
    assert (default.every_steps, default.keep_last, default.max_steps) == (1000, 3, None)


def test_the_next_boundary_is_the_next_multiple_of_every_steps_up_to_max_steps():
    policy = _policy(every_steps=200, max_steps=500)
    assert [policy.next_boundary(s) for s in (0, 1, 199, 200, 399, 400, 450, 500)] == [
        200,
        200,
        200,
        400,
        400,
        500,
        500,
        500,
    ]
    assert _policy(every_steps=None, every_secs=60.0, max_steps=500).next_boundary(120) == 500
    with pytest.raises(ValueError, match="retention only"):
        CheckpointPolicy.from_spec(CheckpointSpec()).next_boundary(0)


def test_a_step_off_the_step_cadence_short_of_max_steps_is_off_cadence():
    policy = _policy(every_steps=200, max_steps=500)
    assert [policy.is_off_cadence(s) for s in (199, 200, 201, 400, 499, 500)] == [
        True,
        False,
        True,
        False,
        True,
        False,
    ]
    # By time only: every step short of max_steps is off the (step) cadence.
    by_time = _policy(every_steps=None, every_secs=5.0, max_steps=500)
    assert by_time.is_off_cadence(200) and not by_time.is_off_cadence(500)
    assert not CheckpointPolicy.from_spec(CheckpointSpec()).is_off_cadence(7)  # no max_steps


def test_a_checkpoint_is_due_every_secs_after_the_last_save():
    clock = FakeClock(100.0)
    policy = _policy(clock, every_steps=1000, every_secs=10.0)
    part = clock()
    clock.now = 109.9
    assert policy.due(part, None) is None
    clock.now = 110.0
    assert policy.due(part, None) == "checkpoint"
    policy.saved()
    assert policy.due(part, None) is None
    clock.now = 119.0
    assert policy.due(part, None, forced=True) == "checkpoint"  # a notice, a lost lease
    # By steps only: never due by time.
    steps_only = _policy(clock, every_steps=10)
    clock.now = 1e9
    assert steps_only.due(clock(), None) is None


def test_a_backup_is_due_backup_every_seconds_into_the_part_unless_storage_is_busy():
    clock = FakeClock(0.0)
    policy = _policy(clock, every_steps=1000, every_secs=100.0)
    clock.now = 50.0
    part = clock()  # (an evaluation before the part does not count)
    clock.now = 52.9
    assert policy.due(part, 3.0) is None
    clock.now = 53.0
    assert policy.due(part, 3.0) == "backup"
    assert policy.due(part, 3.0, busy=lambda: True) is None
    assert policy.due(part, None) is None
    clock.now = 100.0  # a regular checkpoint comes first
    assert policy.due(part, 3.0) == "checkpoint"
    asked = []
    policy.due(part, 3.0, forced=True, busy=lambda: asked.append(1) or False)
    assert asked == []  # storage is asked only when a backup is due


def test_a_first_steps_wait_for_its_compile_counts_towards_neither_cadence():
    clock = FakeClock(0.0)
    policy = _policy(clock, every_steps=1000, every_secs=10.0)
    part = clock()
    clock.now = 7.9  # a first step done after a 5 s wait for its compile: 2.9 s of training
    assert policy.due(part, 3.0, compile_wait=5.0) is None
    assert policy.due(part, 3.0) == "backup"  # what counting the wait would do
    clock.now = 12.0
    assert policy.due(part, 3.0, compile_wait=5.0) == "backup"  # 7 s of training
    assert policy.due(part, None, compile_wait=5.0) is None
    clock.now = 15.0
    assert policy.due(part, None, compile_wait=5.0) == "checkpoint"


def test_the_train_role_keeps_steps_until_evaluated_unless_told_otherwise():
    spec = CheckpointSpec(every_steps=10)
    assert CheckpointPolicy.spec_for_role(spec, "train").keep_until_evaluated is True
    assert CheckpointPolicy.spec_for_role(spec, "train_and_evaluate") is spec
    off = CheckpointSpec(every_steps=10, keep_until_evaluated=False)
    assert CheckpointPolicy.spec_for_role(off, "train") is off


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


def _life(start, end_record, ended, saves, save_s, dead=2.0):
    """An attempt that started at `start`, wrote its last record at `end_record`, spent `dead` s in
    start-up, restore and compile, and `save_s` s blocked by its `saves` timed saves."""
    times = {"startup": dead / 2, "restore": dead / 4, "compile": dead / 4}
    return {
        **_attempt(start, end_record, 0, 0, [], ended, **times),
        "saves": saves,
        "save_s": save_s,
    }


def test_backup_every_asks_the_ledger_and_says_so_once_per_attempt(caplog):
    clock = FakeClock(125.0)
    current = _life(120, 120, None, 0, 0.0)
    ledger = SimpleNamespace(
        attempt=current, earlier=[_life(0, 50, None, 4, 0.4), _life(60, 110, None, 4, 0.4)]
    )
    policy = _policy(clock, every_steps=10)
    with caplog.at_level(logging.WARNING, logger="prefect_jax.trainer"):
        seconds = policy.backup_every(ledger, "j")
        assert seconds == pytest.approx(
            (2 * 0.1 * 49.5) ** 0.5
        )  # `backup_interval` at the wall clock
        assert current["backup_every_secs"] == round(seconds, 3)
        clock.now = 125.0 + 3600
        assert policy.backup_every(ledger, "j") > 3 * seconds
    said = [r.getMessage() for r in caplog.records if "backing up every" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("job j: 2 of its 2 latest attempts were killed")
    assert _policy(clock, every_steps=10, backups=False).backup_every(ledger, "j") is None
    assert (
        policy.backup_every(SimpleNamespace(attempt=current, earlier=None), "j") is None
    )  # not written yet
    assert policy.backup_every(SimpleNamespace(attempt=None, earlier=[]), "j") is None  # no attempt
    never_killed = SimpleNamespace(
        attempt=_life(120, 120, None, 0, 0.0), earlier=[_life(0, 50, "finished", 5, 0.5)]
    )
    assert policy.backup_every(never_killed, "j") is None


class _Step:
    def __init__(self, step):
        self.step = step


def test_orbax_keeps_what_retained_keeps():
    steps = [100, 150, 200, 250, 260, 300]
    backups = {150, 250, 260}
    for spec, newest_evaluated in [
        (CheckpointSpec(keep_last=2), None),
        (CheckpointSpec(keep_last=None), None),
        (CheckpointSpec(keep_last=1, keep_every_steps=100), None),
        (CheckpointSpec(keep_last=1, keep_until_evaluated=True), 100),
        (CheckpointSpec(keep_last=1, keep_until_evaluated=True), None),
    ]:
        policy = CheckpointPolicy.from_spec(spec)
        orbax = policy.preservation(
            backups.__contains__,
            lambda s: False,
            lambda newest_evaluated=newest_evaluated: newest_evaluated,
        )
        kept = orbax.should_preserve([_Step(s) for s in steps], context=None)
        assert {s for s, k in zip(steps, kept, strict=True) if k} == policy.retained(
            steps, newest_evaluated, backups.__contains__
        )
    # By time: the steps' own save times (backups aside), Orbax's decisions and retained's alike
    times = {100: 0.0, 150: 10.0, 200: 50.0, 250: 55.0, 260: 58.0, 300: 70.0}
    for secs, expected in [(60.0, {100, 300}), (40.0, {100, 200, 300})]:
        policy = CheckpointPolicy.from_spec(CheckpointSpec(keep_last=1, keep_every_secs=secs))
        orbax = policy.preservation(backups.__contains__, lambda s: False, None, times.get)
        kept = orbax.should_preserve([_Step(s) for s in steps], context=None)
        assert {s for s, k in zip(steps, kept, strict=True) if k} == expected
        assert policy.retained(steps, None, backups.__contains__, times.get) == expected
    # A pinned step (its upload pending) is kept whatever retention says.
    orbax = CheckpointPolicy.from_spec(CheckpointSpec(keep_last=1)).preservation(
        backups.__contains__, {150}.__contains__
    )
    kept = orbax.should_preserve([_Step(s) for s in steps], context=None)
    assert {s for s, k in zip(steps, kept, strict=True) if k} == {150, 300}


def test_keep_every_secs_keeps_the_oldest_step_of_each_window_whatever_else_goes():
    """TF's keep_checkpoint_every_n_hours: by the times the steps record, the oldest of each
    window of wall-clock time; a step's fate is its window's alone, so deleting or setting aside
    one step never makes another one go; a step whose time could not be read is kept."""
    from prefect_jax.training.policy import kept_by_time

    at = {10: 100.0, 20: 130.0, 30: 161.0, 40: 190.0, 50: 222.0, 60: None, 70: 290.0}
    assert kept_by_time([10, 20, 30, 40, 50], at.get, 60.0) == {10, 20, 40}  # windows 1, 2, 3
    assert kept_by_time([10, 20, 30, 40, 50, 60, 70], at.get, 60.0) == {10, 20, 40, 60, 70}
    assert kept_by_time([20, 30, 40, 50], at.get, 60.0) == {20, 40}  # 10 set aside: the rest stay
    assert kept_by_time([10, 20, 30, 50], at.get, 60.0) == {
        10,
        20,
        50,
    }  # 40 gone: its window's next


def test_backups_follow_young_daly_from_the_kills_the_ledger_shows():
    current = _life(120, 120, None, 0, 0.0)
    # Never killed, or only preempted with notice (the step in flight was checkpointed): no backups.
    assert (
        backup_interval(
            [_life(0, 50, "finished", 5, 0.5), _life(60, 110, "closed", 5, 0.5)], current, now=125
        )
        is None
    )
    assert (
        backup_interval(
            [_life(0, 50, "preempted", 5, 0.5), _life(60, 110, "preempted", 5, 0.5)],
            current,
            now=125,
        )
        is None
    )
    # Two kills, each less than a save interval after the attempt's last record. Exposed: 48 s
    # each (their last record less their 2 s of start-up, restore and compile), and this attempt's
    # 3 s so far. A save blocked training 0.1 s (0.8 s over 8 timed saves).
    earlier = [_life(0, 50, None, 4, 0.4), _life(60, 110, None, 4, 0.4)]
    seconds, why = backup_interval(earlier, current, now=125)
    assert why == {
        "killed": 2,
        "of_attempts": 2,
        "mean_secs_between_kills": 49.5,
        "save_secs": 0.1,
        "saves_timed": 8,
    }
    assert seconds == pytest.approx((2 * 0.1 * 49.5) ** 0.5)
    # The longer this attempt goes without a kill, the rarer the backups.
    assert backup_interval(earlier, current, now=125 + 3600)[0] > 3 * seconds
    # One of two attempts killed: the time both trained counts against that one kill.
    _, why = backup_interval(
        [_life(0, 50, "preempted", 4, 0.4), _life(60, 110, None, 4, 0.4)], current, now=125
    )
    assert why["killed"] == 1 and why["mean_secs_between_kills"] == pytest.approx(99.0)
    # A multi-process job's attempt cut short by another process's death is a kill of the job;
    # one that failed on its own is not.
    _, why = backup_interval(
        [_life(0, 50, "failed", 4, 0.4), _life(60, 110, LOST_PROCESS, 4, 0.4)], current, now=125
    )
    assert why["killed"] == 1
    assert backup_interval([_life(0, 50, "failed", 4, 0.4)], current, now=125) is None
    # Only the newest attempts count: kills long ago do not make a job back up forever.
    old_kills = [_life(i * 60.0, i * 60.0 + 50, None, 4, 0.4) for i in range(3)]
    clean = [_life(180.0 + i * 60.0, 230.0 + i * 60.0, "preempted", 4, 0.4) for i in range(5)]
    assert backup_interval(old_kills + clean, _life(500, 500, None, 0, 0.0), now=505) is None
    # Quick kills and quick saves: never closer than a second (nor than 5 saves' blocking).
    assert (
        backup_interval([_life(0, 2.5, None, 2, 0.004)], _life(3, 3, None, 0, 0.0), now=3.5)[0]
        == 1.0
    )
    assert (
        backup_interval([_life(0, 5, None, 2, 1.0)], _life(6, 6, None, 0, 0.0), now=6.5)[0] == 2.5
    )
    # Killed before any save was timed (kills more often than checkpoints: the job would never get
    # past its first step): one backup as soon as allowed, which times a save; then the formula.
    seconds, why = backup_interval([_life(0, 50, None, 0, 0.0)], current, now=125)
    assert seconds == 1.0 and why["save_secs"] is None and why["saves_timed"] == 0
    seconds, why = backup_interval(
        [_life(0, 50, None, 0, 0.0)], _life(120, 130, None, 1, 0.1), now=135
    )
    assert why["save_secs"] == 0.1 and seconds == pytest.approx(
        (2 * 0.1 * why["mean_secs_between_kills"]) ** 0.5
    )


def test_backups_are_kept_only_while_newest_and_leave_keep_last_to_the_other_steps():
    backups = {150, 250, 260}
    steps = [100, 150, 200, 250, 260]
    assert retained(steps, CheckpointSpec(keep_last=2), None, backups.__contains__) == {
        100,
        200,
        260,
    }
    assert retained(steps + [300], CheckpointSpec(keep_last=2), None, backups.__contains__) == {
        200,
        300,
    }
    assert retained(steps, CheckpointSpec(keep_last=None), None, backups.__contains__) == {
        100,
        200,
        260,
    }
    # An evaluator elsewhere has reached 100: the steps from it on are kept for it, backups not
    # (it never evaluates them).
    assert retained(
        steps + [300],
        CheckpointSpec(keep_last=1, keep_until_evaluated=True),
        100,
        backups.__contains__,
    ) == {100, 200, 300}
