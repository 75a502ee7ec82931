"""The compiled step functions a `Loop` calls: the guarded train step, its `lax.scan` over K
stacked batches, init compiled as one program, and the ahead-of-time compile of the steps.

Pure functions of the program and the train spec: where the state lives and how the steps
are driven is the `Loop`'s (`prefect_jax.training.loop`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import grain
import jax
import numpy as np

from prefect_jax.training.digests import precompile_digests
from prefect_jax.training.save_handoff import copy_types, precompile_copy
from prefect_jax.training.trees import device_digest_types, to_savable

logger = logging.getLogger("prefect_jax.trainer")

# XLA's backend (LLVM) optimisation level for init, a program that runs once: a lower level
# compiles it in a fraction of the default's time. Floats may differ from the default's in their
# last bits (for the digits MLP they do not); a rerun that initialises again compiles it the same
# way, so it gets the same state, bit for bit.
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def guard_int(value: int):
    """An int32 scalar for the step guard: a numpy scalar, so making one dispatches nothing."""
    return np.int32(value)


def metric_sums(metric_shapes) -> dict:
    """Zeroed float32 sums, one per train metric (`metric_shapes`: ``jax.eval_shape`` of the
    program's `train_step` metrics): the accumulator a fresh guard starts from."""
    return {k: np.zeros(np.shape(v), np.float32) for k, v in metric_shapes.items()}


def new_guard(step: int, sums: dict, log_every: int, target: int, n=0) -> tuple:
    """The carried guard of `guarded_step`, host values: ``(count, first_bad, (sums, n,
    log_every, target))``. The train metrics' sums since the last log point live in it, on
    the device; `log_every` and `target` are values, not constants, so a new target compiles
    nothing."""
    n = n if hasattr(n, "dtype") else guard_int(n)  # (a device count stays there)
    # (an interval with no end step, `policy.NO_END`, is past any int32 count: the largest one)
    target = min(target, int(np.iinfo(np.int32).max))
    accumulator = (sums, n, guard_int(log_every), guard_int(target))
    return (guard_int(step), guard_int(-1), accumulator)


def guarded_step(train_step: Callable, check_finite: bool) -> Callable:
    """Wrap `train_step` to also count steps, remember the first with a NaN/Inf loss, and
    return as its metrics the mean of each metric over the steps since the previous log point
    (a multiple of ``log_every`` or the target), all on the device: the loop never waits for
    the means it logs."""
    import jax.numpy as jnp

    def step(state, batch, guard):
        given = state
        state, metrics = train_step(state, batch)
        refuse_another_state(given, state)
        count, first_bad, (sums, n, log_every, target) = guard
        count = count + 1
        if check_finite and metrics:
            keys = [k for k in metrics if "loss" in k] or list(metrics)
            finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(metrics[k])) for k in keys]))
            first_bad = jnp.where((first_bad < 0) & ~finite, count, first_bad)
        sums = {k: sums[k] + jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        n = n + 1
        means = {k: s / n.astype(jnp.float32) for k, s in sums.items()}
        # A log point logs these means; the next one starts from zero.
        logs = (count % log_every == 0) | (count == target)
        sums = {k: jnp.where(logs, jnp.zeros_like(s), s) for k, s in sums.items()}
        n = jnp.where(logs, jnp.zeros_like(n), n)
        return state, means, (count, first_bad, (sums, n, log_every, target))

    return step


def refuse_another_state(given, returned) -> None:
    """As the train step is traced: refuse (`ProgramError`, naming the differences) a
    `train_step` whose returned state is not the tree it was given, as init made it (a missing or
    extra leaf, another shape or dtype); jit would say it in its own terms, about out_shardings."""
    from prefect_jax.training.program import ProgramError
    from prefect_jax.training.trees import describe_tree, tree_differences

    # (both trees' leaves are tracers: the program's step is a jit of its own, `jit_steps`)
    diffs = tree_differences(
        describe_tree(returned), describe_tree(given), ("state it returns", "init")
    )
    made, back = jax.tree.structure(given), jax.tree.structure(returned)
    if not diffs and back != made:  # (the same leaves in other containers)
        diffs = [f"its tree is {str(back)[:300]}, init's {str(made)[:300]}"]
    if diffs:
        raise ProgramError(
            "train_step(state, batch) must return the state it was given, as init made it (the "
            f"same paths, shapes and dtypes; new values): {'; '.join(diffs[:5])}"
            + (f"; and {len(diffs) - 5} more" if len(diffs) > 5 else "")
        )


def scanned(step: Callable) -> Callable:
    """`step(state, batch, guard)` over a leading axis of stacked batches, in one `lax.scan`:
    returns (state, metrics stacked per step, guard)."""

    def run(state, batches, guard):
        def body(carry, batch):
            state, metrics, guard = step(carry[0], batch, carry[1])
            return (state, guard), metrics

        (state, guard), metrics = jax.lax.scan(body, (state, guard), batches)
        return state, metrics, guard

    return run


def jit_steps(
    program: Any, check_finite: bool, shardings: tuple | None = None
) -> tuple[Callable, Callable, Callable, Callable]:
    """The program's steps, jitted: its train step alone (`program_step`), the guarded train
    step (`guarded_step`), the same over K stacked batches (`scanned`), and the eval step.

    The guarded steps call the jitted `program_step`, so the program's train step is traced
    once for its shapes: the trace the metrics' structure takes (`TrainMeans`,
    `precompile_steps`) is the one the guarded step's own trace finds in jit's cache. A model's
    trace can take seconds, and each was on the way to a restart's first step. The nested jit
    is inlined by XLA: the executable computes the same.

    Args:
        program: the program.
        check_finite: whether the guard watches the loss for NaN/Inf.
        shardings: for a program with a mesh (`prefect_jax.training.sharding`): the state's
            shardings (a pytree), the batch's, the stacked batches' and the replicated one on
            its mesh. The train steps take and return the state so (no resharding between
            steps, donation reuses each buffer) and are traced under the mesh. None: the
            arguments' placement decides.
    """
    # The state is donated: each step writes the new state over the old one's buffers (on
    # GPU/TPU, and on the CPU since jaxlib 0.3.24), instead of copying it into new ones; a
    # buffer another holder still references (Orbax, copying a save to the host) is copied.
    # The guard is never donated: the loop reads an earlier one after later steps ran.
    donate = (0,)
    if shardings is None:
        program_step = jax.jit(program.train_step)
        guarded = guarded_step(program_step, check_finite)
        train_step = jax.jit(guarded, donate_argnums=donate)
        scan_steps = jax.jit(scanned(guarded), donate_argnums=donate)
        return program_step, train_step, scan_steps, jax.jit(program.eval_step)
    from prefect_jax.training.sharding import under_mesh

    state, batch, stacked, replicated = shardings
    mesh = replicated.mesh
    program_step = jax.jit(under_mesh(program.train_step, mesh))
    guarded = guarded_step(program_step, check_finite)
    outs = (state, replicated, replicated)  # metrics and guard: on every device
    train_step = jax.jit(
        guarded, in_shardings=(state, batch, replicated), out_shardings=outs, donate_argnums=donate
    )
    scan_steps = jax.jit(
        scanned(guarded),
        in_shardings=(state, stacked, replicated),
        out_shardings=outs,
        donate_argnums=donate,
    )
    # Eval batches are host arrays of any size (the last may be short): the compiler places
    # them; the state comes committed to its shardings.
    return program_step, train_step, scan_steps, jax.jit(under_mesh(program.eval_step, mesh))


def metrics_at(metrics, index: int | None):
    """One log point's metrics (means since the log point before, see `guarded_step`): as they
    are (one step per dispatch), or row `index` of a scan's stack."""
    return metrics if index is None else jax.tree.map(lambda m: m[index], metrics)


def compiled_init(init_from_seed: Callable, seed, sharding) -> Callable | None:
    """`init_from_seed` jitted with its output on `sharding` and compiled for a quick compile
    (`INIT_COMPILER_OPTIONS`: it runs once), or with the backend's defaults where the options
    are refused. None when init cannot be traced (it reads values on the host): run it eagerly.
    """
    try:
        # The key is made inside the program from the seed, an argument (as a constant, XLA
        # could fold init into constants): no eager computation of its own to compile and run
        # first, and one executable (one cache entry) for every seed.
        lowered = jax.jit(init_from_seed, out_shardings=sharding).lower(seed)
    except TypeError:  # jax.errors.ConcretizationTypeError and kin, or a leaf that is not an array
        logger.debug("init cannot be jitted: running it op by op", exc_info=True)
        return None
    try:
        return lowered.compile(compiler_options=INIT_COMPILER_OPTIONS)
    except Exception:  # noqa: BLE001 - a backend without the option: its default
        logger.debug("init's compiler options refused", exc_info=True)
        return lowered.compile()


def abstract_tree(tree, sharding=None):
    """`tree`'s arrays as ``jax.ShapeDtypeStruct``s (with `sharding`): what a trace or a compile
    of the steps takes in place of host values."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding), tree
    )


def precompile_steps(
    program: Any,
    seed: int,
    steps_per_dispatch: int,
    state,
    device,
    program_step,
    train_step,
    scan_steps,
    batch_shardings: tuple | None = None,
) -> None:
    """Compile the jitted `train_step` (or `scan_steps`) for `state` (abstract, on `device`) and
    the shapes of the program's first batches, so the real call finds the executable in jit's
    cache (`program_step`: the jitted program step they call, see `jit_steps`). Only for Grain
    MapDatasets, whose first batch is read by index without starting the pipeline; any failure
    is left for the real call to report. `batch_shardings`: the (batch, stacked batches)
    shardings a program with a mesh's batches are placed with (part of their type: without it
    the loop's call compiles again)."""
    try:
        train_data = program.train_data(seed)
        if isinstance(train_data, grain.MapDataset):
            batch_sharding, stacked_sharding = batch_shardings or (None, None)
            batch = abstract_tree(train_data[0], batch_sharding)
            guard = jax.tree.map(
                lambda g: jax.ShapeDtypeStruct(g.shape, g.dtype, sharding=device),
                # (the loop's guard: its sums shaped like the step's metrics)
                abstract_tree(
                    new_guard(0, metric_sums(jax.eval_shape(program_step, state, batch)[1]), 1, 1)
                ),
            )
            k = steps_per_dispatch
            if k == 1:
                train_step.lower(state, batch, guard).compile()
            else:
                stacked = jax.tree.map(
                    lambda b: jax.ShapeDtypeStruct(
                        (k, *b.shape), b.dtype, sharding=stacked_sharding
                    ),
                    batch,
                )
                scan_steps.lower(state, stacked, guard).compile()
    except Exception:  # noqa: BLE001 - the real call compiles again and reports it
        logger.debug("background compile of the train step failed", exc_info=True)


def precompile_eval_step(program: Any, state, eval_step) -> None:
    """Compile the jitted `eval_step` for `state` (abstract) and the program's first eval batch
    (a Grain MapDataset's, read by index); any failure is left for the real call to report."""
    try:
        eval_data = program.eval_data()
        if isinstance(eval_data, grain.MapDataset):
            eval_step.lower(state, abstract_tree(eval_data[0])).compile()
    except Exception:  # noqa: BLE001 - the real call compiles again and reports it
        logger.debug("background compile of the eval step failed", exc_info=True)


def eval_compiles_beside_train_step() -> bool:
    """Whether the eval step compiles at the same time as the train step, rather than after it.

    On a GPU or TPU, yes: compiles run on host CPUs the training does not use, and a GPU compile
    autotunes its kernels on the device. Compiled after the train step, the eval step's compile
    ran beside the training: it took several times as long as on an idle device, slowed the
    steps and was not done by the first evaluation (BENCHMARKS.md, the byte LM on a GPU). On a
    CPU, no: the compiles and the training share the same cores, and the eval step is needed
    only at the first checkpoint, the train step at once."""
    return jax.default_backend() != "cpu"


class BackgroundCompile:
    """`precompile_steps` and `precompile_eval_step` on threads of their own: on a CPU the train
    step, then the eval step, on one thread; on an accelerator each on its own, at the same time
    (`eval_compiles_beside_train_step`). The training waits for the train step only
    (`join_train_step`): on a cold start of a real model the eval step takes seconds more. An
    evaluation that comes first needs no join: jit traces and compiles a signature once, a
    second caller waiting for the first (jax 0.10: one trace and one XLA compile with two
    threads calling). `also` compiles more on a thread of its own (`for_live_state`: the state
    fingerprint's, and the saves' copy). The process's end waits for them all (`join`)."""

    def __init__(self):
        self._threads: list[threading.Thread] = []
        self._train_compiled = threading.Event()
        self.started = False
        self.save_copy = False  # the checkpoints copy the state on its devices (`save_handoff`)

    def start(
        self, train_args: tuple, eval_args: tuple, before: Callable[[], Any] | None = None
    ) -> None:
        """`precompile_steps(*train_args)` and `precompile_eval_step(*eval_args)`, after
        `before()` where given (the pull of a remote compilation cache: waited for there, not by
        the caller)."""
        beside = eval_compiles_beside_train_step()

        def run() -> None:
            try:  # (whatever happens here, the first step must not wait for it forever)
                if before is not None:
                    try:
                        before()
                    except Exception:  # noqa: BLE001 - compiled without it; the trainer reports
                        logger.debug("before the background compile", exc_info=True)
                if beside:
                    self.also(precompile_eval_step, *eval_args, name="prefect-jax-compile-eval")
                precompile_steps(*train_args)
            finally:
                self._train_compiled.set()
            if not beside:
                precompile_eval_step(*eval_args)

        self._threads.append(self._thread(run, "prefect-jax-compile"))
        # (only once started: a restore retried after a failed start starts it again)
        self.started = True

    def also(self, fn: Callable[..., Any], *args, name: str = "prefect-jax-compile-more") -> None:
        """`fn(*args)` on a thread of its own, which the process's end waits for (`join`); a
        failure, or a thread that cannot start, is left for the real call to report."""

        def run() -> None:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - the real call compiles again and reports it
                logger.debug("background compile (%s) failed", name, exc_info=True)

        try:
            self._threads.append(self._thread(run, name))
        except RuntimeError:  # (no thread to be had: a pids limit, say)
            logger.debug("background compile (%s) not started", name, exc_info=True)

    def for_live_state(self, local: Callable[[Any], Any], state) -> None:
        """Compile, from the live state's own types, what is run on it later on the device, each
        on a thread of its own rather than where the loop would wait for it: the programs
        `trees.state_fingerprint` runs for ``local(state)`` (its large arrays on an accelerator:
        `device_digest_types`), which the job's end waits for, and with `save_copy` the copy
        `save_handoff.copy_on_device` makes at each save, which the first save would wait for."""
        todo = [(device_digest_types, local, precompile_digests, "digests")]
        if self.save_copy:
            todo.append((copy_types, to_savable, precompile_copy, "save-copy"))
        for types_of, view, precompile, what in todo:
            try:
                types = types_of(view(state))
            except Exception:  # noqa: BLE001 - the real call compiles them itself, and reports it
                logger.debug("the %s' types", what, exc_info=True)
                continue
            if types:
                self.also(precompile, types, name=f"prefect-jax-compile-{what}")

    @staticmethod
    def _thread(target: Callable[[], Any], name: str) -> threading.Thread:
        # Not a daemon: a process must not exit in the middle of an XLA compile (it aborts); and
        # a thread the program starts from it (in `train_data`, say) is not one either. Said
        # outright: a thread inherits its starter's flag, and the trainer's thread is a daemon.
        thread = threading.Thread(target=target, name=name, daemon=False)
        thread.start()
        return thread

    def join_train_step(self) -> None:
        if self.started:
            self._train_compiled.wait()

    def join(self) -> None:
        # (a thread started by one being joined is appended before that one ends, and a list's
        # iterator reaches what is appended to it meanwhile)
        for thread in self._threads:
            thread.join()


__all__ = [
    "BackgroundCompile",
    "INIT_COMPILER_OPTIONS",
    "abstract_tree",
    "compiled_init",
    "eval_compiles_beside_train_step",
    "guard_int",
    "guarded_step",
    "jit_steps",
    "metric_sums",
    "metrics_at",
    "new_guard",
    "precompile_eval_step",
    "precompile_steps",
    "scanned",
]
