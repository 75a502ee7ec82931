"""The evaluation of a state sharded over several processes (`Evaluations._together`) makes the
same collective calls in every process, in the same order, whichever process fails where: one
that calls a collective the others skip waits forever (a hung job, not a failed one).

Two threads stand for two JAX processes; the two collectives `_together` makes (process 0's
`announce` and everyone's `worst`) meet at a barrier. The evaluation itself is replaced by what
each scenario makes it do (the real one, on real processes, is in test_multiprocess_sharding).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from prefect_jax.training import evaluating
from prefect_jax.training.collective import EVALUATE
from prefect_jax.training.evaluating import Evaluations
from prefect_jax.training.evaluation import EvalResult, EvalStatus


class TwoProcesses:
    """Collectives between two threads: each call waits for the other thread's call."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=10)
        self.slots: list = [None, None]
        self.calls: list[list[str]] = [[], []]
        self.rank = threading.local()

    def _exchange(self, name: str, value):
        rank = self.rank.value
        self.calls[rank].append(name)
        self.slots[rank] = value
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()
        return seen

    def announce(self, code):
        return self._exchange("announce", code)[0]

    def worst(self, code):
        return max(self._exchange("worst", code))


def _evaluations(rank: int, evaluate, join) -> Evaluations:
    trainer = SimpleNamespace(
        job=SimpleNamespace(is_primary=rank == 0),
        loop=SimpleNamespace(spans=True),
        step=10,
        config=SimpleNamespace(eval=SimpleNamespace(name="eval", exporters=[])),
    )
    e = object.__new__(Evaluations)
    e.trainer, e.stopped, e.host, e._announced = trainer, None, None, False

    def joined(code):
        e._announced = True
        return join(rank, code)

    e._join = joined
    e._evaluate_if_new = lambda step, force, on_recorded: evaluate(e)
    return e


def _run(monkeypatch, evaluate, join) -> tuple[list, TwoProcesses]:
    world = TwoProcesses()
    monkeypatch.setattr(evaluating, "announce", world.announce)
    monkeypatch.setattr(evaluating, "worst", world.worst)
    outcomes: list = [None, None]

    def process(rank: int):
        world.rank.value = rank
        try:
            outcomes[rank] = _evaluations(rank, evaluate, join)._together(10, False, None)
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcomes[rank] = exc

    threads = [threading.Thread(target=process, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(isinstance(o, threading.BrokenBarrierError) for o in outcomes), outcomes
    assert world.calls[0] == world.calls[1], world.calls  # the same collectives, in order
    return outcomes, world


def _evaluated(e: Evaluations) -> EvalResult:
    """Process 0's evaluation of the live step: every process joins its eval step."""
    e._join(evaluating.announce(EVALUATE))
    return EvalResult(status=EvalStatus.EVALUATED, step=10, metrics={"loss": 1.0}, num_batches=1)


def _fails_everywhere(rank, code):
    raise RuntimeError(f"the eval step failed in process {rank}")


def _fails_in_process_1(rank, code):
    if rank == 1:
        raise MemoryError("process 1 ran out of host memory")


def test_an_eval_step_that_fails_in_every_process_fails_the_evaluation_in_each(monkeypatch):
    (first, second), world = _run(monkeypatch, _evaluated, _fails_everywhere)
    assert "process 0" in str(first) and "process 1" in str(second)
    assert world.calls[0] == ["announce", "worst"]


def test_a_failure_in_one_other_process_fails_process_0_too_so_a_retry_starts_in_both(
    monkeypatch,
):
    (first, second), _ = _run(monkeypatch, _evaluated, _fails_in_process_1)
    assert isinstance(second, MemoryError)
    assert isinstance(first, RuntimeError) and "another process" in str(first)


def test_process_0_failing_before_it_announced_still_meets_the_others(monkeypatch):
    def fails_before(e):
        raise OSError("eval record unreadable")

    (first, second), world = _run(monkeypatch, fails_before, lambda rank, code: None)
    assert isinstance(first, OSError)
    assert isinstance(second, RuntimeError) and "another process" in str(second)
    assert world.calls[0] == ["announce", "worst"]


def test_an_evaluation_that_process_0_stops_ends_evaluating_in_every_process(monkeypatch):
    def stopped(e):
        e._join(evaluating.announce(EVALUATE))
        return EvalResult(
            status=EvalStatus.EVALUATED,
            step=10,
            metrics={"loss": 1.0},
            num_batches=1,
            evaluation_stopped="the listener said so",
        )

    (first, second), _ = _run(monkeypatch, stopped, lambda rank, code: None)
    assert first.status is EvalStatus.EVALUATED
    assert second.status is EvalStatus.EVALUATION_STOPPED and second.step == 10


@pytest.mark.parametrize("status", [EvalStatus.NO_NEW_CHECKPOINT, EvalStatus.THROTTLED])
def test_nothing_to_evaluate_still_meets_the_others_once(monkeypatch, status):
    (first, second), world = _run(
        monkeypatch, lambda e: EvalResult(status=status, step=10), lambda rank, code: None
    )
    assert first.status is status and second.status is EvalStatus.OTHER_PROCESS
    assert world.calls[0] == ["announce", "worst"]
