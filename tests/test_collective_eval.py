"""The evaluation of a state sharded over several processes (`Evaluations._together`) makes the
same collective calls in every process, in the same order, whichever process fails where: one
that calls a collective the others skip waits forever (a hung job, not a failed one).

Two threads stand for two JAX processes; the three collectives `_together` makes (process 0's
two `announce`s: what to evaluate, then whether to gather the state for the exports; and
everyone's `worst`) meet at a barrier. The evaluation itself is replaced by what
each scenario makes it do (the real one, on real processes, is in test_multiprocess_sharding).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from prefect_jax.training import evaluating
from prefect_jax.training.collective import EVALUATE, GATHER
from prefect_jax.training.eval_specs import BestExporter, FinalExporter, LatestExporter
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


def _evaluations(rank: int, evaluate, join, exporters=(), gathered=None) -> Evaluations:
    def local(state):  # the live state's gather to the host (a collective in the real loop)
        gathered.append(rank)
        return f"host copy of {state}"

    trainer = SimpleNamespace(
        job=SimpleNamespace(is_primary=rank == 0, storage=None),
        loop=SimpleNamespace(spans=True, local=local),
        step=10,
        state="the live state",
        config=SimpleNamespace(
            eval=SimpleNamespace(name="eval", exporters=list(exporters)),
            train=SimpleNamespace(max_steps=100),
        ),
    )
    e = object.__new__(Evaluations)
    e.trainer, e.stopped, e.host, e._announced = trainer, None, None, False

    def joined(code):
        e._announced = True
        return join(rank, code)

    e._join = joined
    e._evaluate_if_new = lambda step, force, on_recorded: evaluate(e)
    return e


def _run(monkeypatch, evaluate, join, exporters=(), gathered=None) -> tuple[list, TwoProcesses]:
    world = TwoProcesses()
    monkeypatch.setattr(evaluating, "announce", world.announce)
    monkeypatch.setattr(evaluating, "worst", world.worst)
    outcomes: list = [None, None]

    def process(rank: int):
        world.rank.value = rank
        try:
            e = _evaluations(rank, evaluate, join, exporters, gathered)
            outcomes[rank] = e._together(10, False, None)
            if rank == 0:
                world.host = e.host
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
    assert world.calls[0] == ["announce", "announce", "worst"]


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
    assert world.calls[0] == ["announce", "announce", "worst"]


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
    assert world.calls[0] == ["announce", "announce", "worst"]


_BY_LOSS = {"metric": "loss", "mode": "min"}  # (best.json's judgement: the default exporter's)


@pytest.mark.parametrize(
    "exporters, best, gathers",
    [
        ([LatestExporter()], None, True),
        ([FinalExporter()], None, False),  # step 10 of 100: the final exporter writes nothing
        ([FinalExporter(), LatestExporter()], None, True),
        ([BestExporter()], None, True),  # no best yet: this evaluation is it
        (
            [BestExporter()],
            {"step": 5, "value": 2.0, **_BY_LOSS},
            True,
        ),  # loss 1.0 beats step 5's 2.0
        ([BestExporter()], {"step": 5, "value": 0.5, **_BY_LOSS}, False),  # step 5's 0.5 stands
        ([BestExporter(), FinalExporter()], {"step": 5, "value": 0.5, **_BY_LOSS}, False),
        ([], None, False),
    ],
)
def test_the_state_is_gathered_for_the_exports_only_where_an_exporter_may_write(
    monkeypatch, exporters, best, gathers
):
    """A gather moves the whole sharded state to process 0's host: every process joins it after
    an evaluation where some exporter may write (`exporters.exports_nothing`, with the best so
    far as ``best.json`` holds it), none of them otherwise, and each makes the same collective
    calls either way."""
    from prefect_jax.training import exporters as exporters_module

    monkeypatch.setattr(exporters_module, "read_best", lambda storage, exporter: best)
    gathered: list[int] = []
    codes: list = []
    real = TwoProcesses.announce

    def announce(self, code):
        value = real(self, code)
        if self.rank.value == 0:
            codes.append(value)
        return value

    monkeypatch.setattr(TwoProcesses, "announce", announce)
    (first, second), world = _run(
        monkeypatch, _evaluated, lambda rank, code: None, exporters, gathered
    )
    assert first.status is EvalStatus.EVALUATED and second.status is EvalStatus.OTHER_PROCESS
    assert world.calls[0] == ["announce", "announce", "worst"]
    assert codes == [EVALUATE, GATHER if gathers else 0]
    assert sorted(gathered) == ([0, 1] if gathers else [])
    assert world.host == ((10, "host copy of the live state") if gathers else None)


def test_a_failure_in_another_process_still_meets_process_0_at_every_collective(monkeypatch):
    gathered: list[int] = []
    (first, second), world = _run(
        monkeypatch, _evaluated, _fails_in_process_1, [LatestExporter()], gathered
    )
    assert isinstance(second, MemoryError) and isinstance(first, RuntimeError)
    assert world.calls[0] == ["announce", "announce", "worst"]
    # Process 0 learns of process 1's failure at `worst`, after it said to gather: both joined it.
    assert sorted(gathered) == [0, 1]
