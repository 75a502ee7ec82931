"""How training advances: the input iterator, the placement of state and batches, the NaN
guard and progress, over the compiled steps of `prefect_jax.training.compiled_steps`.

A `Loop` knows the program and the train spec, never the job's storage: it turns a state, a
step and an iterator into a later state, step and iterator, and tells who listens how far it
got. Checkpoints, eval records and MLflow are the `Job`'s (`prefect_jax.training.job`).

Example:
    ```python
    from prefect_jax.examples.digits import tiny as program
    from prefect_jax.training import train_means
    from prefect_jax.training.loop import Loop
    from prefect_jax.training.specs import TrainSpec

    loop = Loop(program, TrainSpec(max_steps=100))
    state, it = loop.place(loop.init_state()), loop.fresh_iter()
    interval = loop.run(state, 0, it, target=100, stop=lambda: False)
    print(interval.step, train_means.train_rows(interval.logged)[-1])
    ```
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from prefect_jax.training.collective import (
    global_batch,
    host_gather,
    spanning_fingerprint,
    spans_processes,
)
from prefect_jax.training.compiled_steps import (
    BackgroundCompile,
    abstract_tree,
    compiled_init,
    jit_steps,
    metrics_at,
)
from prefect_jax.training.data_positions import (
    iterate,
    next_batch,
    refuse_fewer_batches_than_steps,
    stack,
)
from prefect_jax.training.evaluation import evaluate_pass
from prefect_jax.training.progress import listening, notify_progress
from prefect_jax.training.sharded_state import (
    placement_naming_params,
    sharded_abstract_state,
    traced_init,
    warn_of_idle_axes,
    whole_where_indivisible,
)
from prefect_jax.training.sharding import (
    check_batch,
    declares_sharding,
    init_with_mesh,
    process_parts,
    replicas,
)
from prefect_jax.training.specs import TrainSpec
from prefect_jax.training.state_memo import StateMemo
from prefect_jax.training.train_means import TrainMeans, throughput
from prefect_jax.training.trees import state_fingerprint


class NonFiniteAt(Exception):
    """Raised inside `Loop.run` at the first NaN/Inf loss: the step and its metrics."""

    def __init__(self, step: int, metrics: dict[str, float]):
        super().__init__(step, metrics)
        self.step, self.metrics = step, metrics


@dataclass
class Interval:
    """Where one `Loop.run` ended: the state and step reached and the metrics logged on the way,
    as ``(step, metrics, row, rates)`` (metrics: the means since the log point before, on the
    device; row: None for one dispatched step, else its row in a scan's stack; rates: the
    throughput, host floats)."""

    state: Any
    step: int
    logged: list[tuple[int, Any, int | None, dict[str, float]]]


class Loop:
    """The loop over one program's compiled steps (`compiled_steps.jit_steps`): where the state
    and the batches live, and how far each call goes.

    Args:
        program: the program (see `prefect_jax.training.program`).
        spec: the train spec (seed, steps per dispatch, logging cadence, NaN check).
        params: the program params it was built with (a refused mesh names the one that set it).
    """

    def __init__(self, program: Any, spec: TrainSpec, params: dict | None = None):
        self.program, self.spec = program, spec
        self._rng = None  # see `rng`
        self._abstract = None
        # The join of the compile and the first step, once per process (goodput).
        self.compile_s: float | None = None
        self.compiling = BackgroundCompile()  # see `start_precompile`
        # The final state's fingerprint and evaluation, computed while its checkpoint commits
        self.memo = StateMemo()
        devices = jax.devices()
        # On one device (CPU, or one GPU) the state is committed to it, so that the compile done
        # ahead of time (`start_precompile`) is the one the loop finds; several devices: no
        # precompile, unless the program declares its sharding.
        self.one_device = (
            jax.sharding.SingleDeviceSharding(devices[0]) if len(devices) == 1 else None
        )
        # Several JAX processes (`prefect_jax.training.cluster`), or a program that declares its
        # mesh or shardings (`prefect_jax.training.sharding`): a mesh over every device of every
        # process; else (one process) the one-device behaviour, on any number of devices.
        self.processes = jax.process_count()
        self.sharded = declares_sharding(program)
        # A state sharded over several processes: what process 0 did alone with a replica is a
        # collective (`prefect_jax.training.collective`).
        self.spans = spans_processes(self.sharded, self.processes)
        placed = placement_naming_params(program, devices, self.processes, params)
        placed = placed or (None,) * 4
        self.mesh, self.replicated, self.batch_sharding, self._stacked_sharding = placed
        shardings = None  # (the steps jitted with the placement's shardings: a program's own)
        if self.sharded:
            self.one_device = None
            self.state_sharding = None  # one per leaf, set by `abstract_state` below
            self.abstract_state  # noqa: B018 - its shardings checked now, before any compute
            warn_of_idle_axes(self.mesh, self.state_sharding, self.batch_sharding)
            shardings = (self.state_sharding, self.batch_sharding, self._stacked_sharding)
            shardings += (self.replicated,)
        else:
            self.state_sharding = self.one_device or self.replicated
        self.program_step, self.train_step, self.scan_steps, self.eval_step = jit_steps(
            program, spec.check_finite, shardings
        )
        if self.sharded:  # its guard replicated over the mesh
            place_guard = lambda guard: jax.device_put(guard, self.replicated)  # noqa: E731
        else:
            place_guard = self.place
        self.means = TrainMeans(self.program_step, spec.log_every_steps, place_guard)

    # -- state and data ------------------------------------------------------------------

    @property
    def rng(self):
        """Init's key, made when first used. A rerun restores and needs none; the key would be
        the process's first JAX computation, compiled (or loaded from the cache) on the rerun's
        way to its first step."""
        if self._rng is None:
            self._rng = jax.random.key(self.spec.seed)
        return self._rng

    def _init_from_seed(self, seed):
        """The program's init from its seed's key, made inside the trace: what init compiles and
        what the abstract state traces (a traced `jax.random.key(seed)` is the eager key, for
        every seed). A program with a mesh is given it and traced under it (`traced_init`)."""
        if self.sharded:
            return traced_init(self.program, self.mesh)(seed)
        return self.program.init(jax.random.key(seed))

    @property
    def abstract_state(self):
        """``jax.eval_shape`` of init: the structure a restore must match (traced with an
        abstract key: no computation runs)."""
        if self._abstract is None:
            if self.sharded:  # the program's own: Orbax restores each leaf sharded, resharding
                self._abstract, self.state_sharding = sharded_abstract_state(
                    self.program, self.mesh, self.spec.seed
                )
                return self._abstract
            shapes = jax.eval_shape(self._init_from_seed, np.int64(self.spec.seed))
            # With the sharding the live state has: a checkpoint written by another number of
            # devices or processes is restored into this one's layout (Orbax reshards it).
            self._abstract = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.state_sharding),
                shapes,
            )
        return self._abstract

    def init_state(self):
        """The program's `init`, compiled as one XLA program and placed on the one device.

        Run op by op, init dispatches (and compiles) every operation on its own, while the
        train step compiles on another thread. An init that cannot be traced (it reads values
        on the host) runs eagerly."""
        if self.state_sharding is not None:
            seed = np.int64(self.spec.seed)
            init = compiled_init(self._init_from_seed, seed, self.state_sharding)
            if init is not None:
                return init(seed)
        if self.sharded:  # eagerly, with the mesh in context for its sharding annotations
            with jax.set_mesh(self.mesh):
                return init_with_mesh(self.program.init, self.mesh)(self.rng)
        return self.program.init(self.rng)

    def fresh_iter(self):
        dataset = self.program.train_data(self.spec.seed)
        refuse_fewer_batches_than_steps(dataset, self.spec.max_steps)
        return iterate(dataset, getattr(self.program, "read_options", None))

    def place(self, state):
        """Commit a state to the one device, or replicate it over every device (a restored state
        already is; an initialised one may not be)."""
        sharding = self.state_sharding
        return state if sharding is None else jax.device_put(state, sharding)

    def local(self, tree):
        """This process's own replica of a replicated state (several processes: a jitted call
        on it runs here alone, as process 0's evaluations and exports do); a state sharded over
        several processes gathered to process 0's host, None in the others (a collective: every
        process calls it); else `tree`."""
        if self.spans:
            return host_gather(tree)
        return tree if self.processes == 1 else replicas(tree, self.processes)

    def fingerprint(self, state) -> str | None:
        """`state_fingerprint`; of a state over several processes `spanning_fingerprint`'s (a
        collective: computed every time, in every process)."""
        if self.spans:
            return spanning_fingerprint(state)
        local = self.local(state)
        return self.memo.get(local, "fingerprint", lambda: state_fingerprint(local))

    def batch(self, host_batch, axis: int = 0):
        """A batch for the step: as it is on one device; else split along `axis` over every
        device (`process_parts`; a program's own batch sharding: as it places it)."""
        if self.batch_sharding is None:
            return host_batch
        sharding = self.batch_sharding if axis == 0 else self._stacked_sharding
        if not self.sharded:
            return process_parts(host_batch, sharding, axis, self.processes)
        check_batch(host_batch, self.batch_sharding, axis)
        if self.spans:  # each process's devices take their parts, wherever the mesh has them
            return global_batch(host_batch, sharding)
        # One process: the whole batch is its own.
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), host_batch
        )

    def batch_type(self, host_batch):
        """A host batch as the metrics' structure is traced from it (`TrainMeans.guard`): its
        shapes with the sharding `batch` places it with (the one the background compile traced
        with), so that the trace the step makes is the one jit's cache returns; as it is where
        the batch stays on the host."""
        if self.batch_sharding is None:
            return host_batch
        return abstract_tree(host_batch, self.batch_sharding)

    # -- compilation ---------------------------------------------------------------------

    def start_precompile(self, before: Callable[[], Any] | None = None) -> None:
        """Compile the train and eval steps for the job's shapes on background threads
        (`BackgroundCompile`, after `before()`), overlapping the restore: the first call finds
        the executable in jit's cache. Only for Grain MapDatasets (their first batch read by
        index, without starting the pipeline); a failure is left for the real call to report."""
        if self.compiling.started or (self.one_device is None and not self.sharded):
            return
        if self.sharded:  # the abstract state carries the shardings the steps are jitted with
            state, guard_sharding = self.abstract_state, self.replicated
        else:
            # The state the loop gets is committed to the one device (see `place`): a spec
            # without that sharding would compile an executable the loop never finds.
            state = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.one_device),
                self.abstract_state,
            )
            guard_sharding = self.one_device
        train = (self.program, self.spec.seed, self.spec.steps_per_dispatch, state)
        train += (guard_sharding, self.program_step, self.train_step, self.scan_steps)
        train += ((self.batch_sharding, self._stacked_sharding) if self.sharded else None,)
        self.compiling.start(train, (self.program, state, self.eval_step), before=before)

    # -- the loop ------------------------------------------------------------------------

    def run(self, state, step: int, it, target: int, stop: Callable[[], bool]) -> Interval:
        """Train from `step` to `target`, or until `stop()` says so (checked after each dispatch,
        once the dispatch before it has run).

        Metrics stay on the device; the NaN guard of a log point is read one log point later,
        so the loop never waits on the device. Each log point's metrics are the means over the
        steps since the log point before (summed on the device, in the guard: `TrainMeans`),
        plus the throughput (`throughput`). Raises `NonFiniteAt` at the first NaN/Inf loss.
        """
        spec = self.spec
        log_every, per_dispatch = spec.log_every_steps, spec.steps_per_dispatch
        logged: list[tuple[int, Any, int | None, dict[str, float]]] = []
        if self.processes > 1:
            from prefect_jax.training.cluster import any_process
        checked = None  # the guard of the previous log point
        # This process's first step: timed to the end (compile or cache load).
        first = self.compile_s is None
        t_first = time.perf_counter()
        self.compiling.join_train_step()  # its executable is the one this loop calls
        guard = previous = None
        clock = (step, time.perf_counter())  # the throughput's window starts here
        while step < target:
            start = step
            if per_dispatch == 1:
                batch = next_batch(it, step)
                guard = guard or self.means.guard(state, self.batch_type(batch), step, target)
                state, metrics, guard = self.train_step(state, self.batch(batch), guard)
                step += 1
            else:
                n = min(per_dispatch, target - step)
                batches = [next_batch(it, step + i) for i in range(n)]
                guard = guard or self.means.guard(state, self.batch_type(batches[0]), step, target)
                state, metrics, guard = self.scan_steps(
                    state, self.batch(stack(batches, step), axis=1), guard
                )
                step += n
            if first:
                jax.block_until_ready(guard)
                self.compile_s, first = time.perf_counter() - t_first, False
                clock = (step, time.perf_counter())  # throughput without the compile
                if not self.spans:  # (a state over several processes: collectives, at the end)
                    self.compiling.for_live_state(self.local, state)
            due = [s for s in range(start + 1, step + 1) if s % log_every == 0 or s == target]
            if due:
                rates, clock = throughput(self.program, clock, step), (step, time.perf_counter())
                logged.extend(
                    (s, metrics, None if per_dispatch == 1 else s - start - 1, rates) for s in due
                )
                if checked is not None:
                    self.check_finite(checked, logged)
                checked = guard
                if listening():
                    shown = metrics_at(*logged[-1][1:3])
                    notify_progress(step, spec.max_steps, {**shown, **rates})
            # One dispatch ahead of the device at most: what `stop` judges by the clock (a backup
            # or a checkpoint due by time, a notice's checkpoint) is then the steps done. Else
            # the host queues a whole interval in milliseconds, no backup is ever due within it,
            # and a SIGTERM's checkpoint waits for every step queued. The device still has the
            # step just dispatched to run while the host prepares the next.
            if previous is not None:
                jax.block_until_ready(previous)
            previous = metrics
            if self.processes == 1:
                if stop():
                    break
            elif due and step < target and any_process(stop())[0]:
                break  # several processes stop together, at a log point, if any of them asks
        if guard is not None:
            self.means.keep(step, guard)
            self.check_finite(guard, logged)
        return Interval(state, step, logged)

    def check_finite(self, guard, logged) -> None:
        """Raise `NonFiniteAt` if the guard saw a NaN/Inf loss (with that step's logged metrics)."""
        if not self.spec.check_finite:
            return
        first_bad = int(guard[1])
        if first_bad >= 0:
            shown = {}
            for s, m, row, _ in logged:
                if s >= first_bad:
                    shown = {k: float(v) for k, v in jax.device_get(metrics_at(m, row)).items()}
                    break
            raise NonFiniteAt(first_bad, shown)

    # -- evaluation ----------------------------------------------------------------------

    def evaluate(
        self, state, steps: int | None, give_up: Callable[[], bool] | None = None
    ) -> tuple[dict[str, float], int, int | None]:
        """`eval_step` over the program's eval data (at most `steps` batches), aggregated
        exactly, with the program's derived metrics (``derive_metrics``); `evaluate_ahead`'s
        result where it evaluated this very state. A state over several processes is evaluated
        by all of them together, every time. `EvaluationAbandoned` before a batch where
        `give_up()` is True (not over several processes: their batches are a collective)."""
        if self.spans:
            return self._evaluate(state, steps)
        return self.memo.take(
            state, ("eval", steps), lambda: self._evaluate(state, steps, give_up=give_up)
        )

    def evaluate_ahead(self, state, steps: int | None, stop: Callable[[], bool]) -> None:
        """Evaluate `state` now, for the next `evaluate` of it; within a batch of the device, and
        `EvaluationAbandoned` at the first batch boundary where `stop()` is True. Not a state
        over several processes (its evaluation is a collective they make together)."""
        if not self.spans:
            self.memo.get(state, ("eval", steps), lambda: self._evaluate(state, steps, stop))

    def _evaluate(
        self,
        state,
        steps: int | None,
        stop: Callable | None = None,
        give_up: Callable | None = None,
    ) -> tuple:
        # (several processes: global batches, whole in each, so the sums come out replicated)
        place = (lambda b: global_batch(b, self.replicated)) if self.spans else None
        place = whole_where_indivisible(self.batch) if self.sharded and not self.spans else place
        return evaluate_pass(self.program, self.eval_step, state, steps, place, stop, give_up)
