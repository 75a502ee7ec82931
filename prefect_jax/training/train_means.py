"""Train metrics as means: each log point logs the mean of every metric over the steps since the
log point before, not one step's value (a noisy curve), plus the throughput.

The sums live in the guard the compiled step carries (`compiled_steps.new_guard`), on the
device, so the loop never waits for them. A `run` that ends between log points (a preemption's
or a backup's checkpoint) leaves its sums here for the next `run` from that step, and a
checkpoint keeps them in its metadata (`carried_sums`), so a resumed job logs the means an
uninterrupted one does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from prefect_jax.training.compiled_steps import metric_sums, metrics_at, new_guard


def train_step_metrics(returned) -> Mapping:
    """The metrics of what `train_step` returned as traced (`jax.eval_shape`'s), refused
    (`ProgramError`, naming the fix) unless it is ``(state, metrics)`` with metrics a dict of
    scalars: jit's own errors came later and named neither (``KeyError: 1`` for a state alone;
    a per-example loss failed as its first log point was read, after an interval's training)."""
    from prefect_jax.training.program import ProgramError

    if not (isinstance(returned, tuple | list) and len(returned) == 2):
        what = f"a {type(returned).__name__}" + (
            f" of {len(returned)}" if isinstance(returned, tuple | list) else ""
        )
        raise ProgramError(
            f"train_step(state, batch) must return a pair (state, metrics), e.g. (state, "
            f"{{'loss': loss}}): it returned {what}"
        )
    metrics = returned[1]
    if not isinstance(metrics, Mapping):
        raise ProgramError(
            "train_step(state, batch) must return (state, metrics) with metrics a dict of scalars, "
            f"e.g. {{'loss': loss}}: its metrics are a {type(metrics).__name__}"
        )
    for name, value in metrics.items():
        shape = getattr(value, "shape", ())
        if shape != ():
            raise ProgramError(
                f"train_step's metric {name!r} has shape {tuple(shape)}: each metric must be a "
                "scalar, its mean over the batch (e.g. losses.mean())"
            )
    return metrics


class TrainMeans:
    """The running sums of one loop's train metrics between log points.

    Args:
        program_step: the jitted program step the compiled steps call (`jit_steps`): its
            structure of metrics is read from its trace, which jit caches for them.
        log_every: the spec's ``log_every_steps``.
        place: puts a guard where the compiled step takes it (the one device, or replicated
            over a sharded program's mesh).
    """

    def __init__(self, program_step: Callable, log_every: int, place: Callable[[Any], Any]):
        self._program_step, self._log_every, self._place = program_step, log_every, place
        self._metric_shapes = None
        self._carried = None  # (step, (sums, n)) where the last `run` ended

    def guard(self, state, batch, step: int, target: int):
        """The guard a call starts from, on the device: the sums the previous call left at
        `step`, else zeros (a fresh or restored state). `batch`: a batch as the step takes it,
        or its type (`Loop.batch_type`)."""
        if self._metric_shapes is None:
            returned = jax.eval_shape(self._program_step, state, batch)
            self._metric_shapes = train_step_metrics(returned)
        sums, n = metric_sums(self._metric_shapes), 0
        carried = self._carried
        if carried is not None and carried[0] == step and set(carried[1][0]) == set(sums):
            sums, n = carried[1]  # on the device already (or restored): nothing waits
        self._carried = None
        # On the device, as every later guard (the step's output) is: a host guard would make
        # the first call compile an executable of its own.
        return self._place(new_guard(step, sums, self._log_every, target, n))

    def keep(self, step: int, guard) -> None:
        """The next call from `step` goes on summing where this one stopped (a part that ended
        off a log point, for a backup); a restore starts from zero."""
        self._carried = (step, guard[2][:2])

    def carried_sums(self, step: int) -> dict | None:
        """The sums since the last log point that a `run` ending at `step` left (None: none), as
        JSON for a checkpoint's metadata: a job restored from a checkpoint taken between log
        points goes on summing from them. Waits for the last step (as a save does)."""
        if self._carried is None or self._carried[0] != step:
            return None
        sums, n = jax.device_get(self._carried[1])
        if not int(n):
            return None
        return {"n": int(n), "sums": {k: float(v) for k, v in sums.items()}}

    def carry(self, step: int, carried: dict | None) -> None:
        """Go on summing from `carried` (`carried_sums` of a restored checkpoint at `step`)."""
        self._carried = None
        if carried:
            sums = {k: np.float32(v) for k, v in carried["sums"].items()}
            self._carried = (step, (sums, np.int32(carried["n"])))


def throughput(program: Any, clock: tuple[int, float], step: int) -> dict[str, float]:
    """Steps (and tokens, for a program with ``tokens_per_step``) per second since `clock` (a
    step and its `time.perf_counter`), as the host dispatched them: over a log interval that is
    the device's rate, since dispatches queue behind the running step."""
    seconds = time.perf_counter() - clock[1]
    if seconds <= 0 or step <= clock[0]:
        return {}
    rates = {"steps_per_sec": (step - clock[0]) / seconds}
    tokens = getattr(program, "tokens_per_step", None)
    if tokens:
        rates["tokens_per_sec"] = rates["steps_per_sec"] * float(tokens)
    return rates


def train_rows(logged) -> list[tuple[str, float, int]]:
    """An interval's logged train metrics as MLflow rows ``(name, value, step)``: each log
    point's means and throughput (one device-to-host copy)."""
    if not logged:
        return []
    values = [(s, {**metrics_at(m, row), **rates}) for s, m, row, rates in jax.device_get(logged)]
    return [(k, float(v), s) for s, m in values for k, v in m.items()]
