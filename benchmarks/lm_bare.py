"""`benchmarks/lm.py`'s bare JAX loop: the byte-level LM trained as a user writes it by hand.

A ``jax.jit`` train step (the state donated), the program's Grain iterator, an Orbax
``CheckpointManager`` of the state and the iterator (async saves, the newest 3 kept), and an eval
summed on the device. `benchmarks/goodput_lm.py`'s plain peer resumes it (`restore`).
"""

from __future__ import annotations

import time


def savable(state):
    """The state as Orbax saves it: typed PRNG keys as their raw key data."""
    import jax

    def raw(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    return jax.tree.map(raw, state)


def manager(directory: str, asynchronous: bool = True):
    """A CheckpointManager as a user writes one: the state and the Grain iterator, newest 3 kept."""
    import grain
    import orbax.checkpoint as ocp

    handlers = {
        "state": ocp.StandardCheckpointHandler(),
        "data": grain.checkpoint.CheckpointHandler(),
    }
    # One deletion thread, as the engine has: Orbax's pool polls its queue, a delay per
    # deleted step on a many-CPU machine that would count against the bare loop alone.
    options = dict(max_to_keep=3, enable_async_checkpointing=asynchronous)
    try:
        opts = ocp.CheckpointManagerOptions(**options, num_deletion_threads=1)
    except TypeError:  # an Orbax without the option
        opts = ocp.CheckpointManagerOptions(**options)
    return ocp.CheckpointManager(directory, item_handlers=handlers, options=opts)


def save_args(state, it):
    import grain
    import orbax.checkpoint as ocp

    return ocp.args.Composite(
        state=ocp.args.StandardSave(savable(state)), data=grain.checkpoint.CheckpointSave(it)
    )


def restore(mgr, step: int, program, it):
    """The state saved at `step` by `save_args` (typed PRNG keys rewrapped); the Grain iterator
    `it` is moved to the position saved with it (`goodput_lm.py`'s resumable bare loop)."""
    import grain
    import jax
    import orbax.checkpoint as ocp

    typed = jax.eval_shape(program.init, jax.random.key(0))
    raw = mgr.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(
                jax.eval_shape(lambda k: savable(program.init(k)), jax.random.key(0))
            ),
            data=grain.checkpoint.CheckpointRestore(it),
        ),
    )["state"]

    def wrap(t, x):
        return (
            jax.random.wrap_key_data(x)
            if jax.dtypes.issubdtype(t.dtype, jax.dtypes.prng_key)
            else x
        )

    return jax.tree.map(wrap, typed, raw)


def evaluate(eval_fn, state, program) -> dict:
    """Every eval batch, sums kept on the device, one read at the end."""
    import jax

    data, totals = program.eval_data(), None
    for i in range(len(data)):
        out = eval_fn(state, data[i])
        totals = out if totals is None else jax.tree.map(lambda a, b: a + b, totals, out)
    return {k: float(s) / float(n) for k, (s, n) in jax.device_get(totals).items()}


def bare(program, args, directory: str | None, step_fn, eval_fn) -> dict:
    """The hand-written loop; `directory` None: no checkpoints. `step_fn` and `eval_fn`: the
    program's steps under ``jax.jit`` (the state donated), shared by both bare sides."""
    import jax

    state = jax.jit(program.init)(jax.random.key(0))
    it = iter(program.train_data(0).to_iter_dataset(program.read_options))
    evaluate(eval_fn, state, program)  # its compile, before the clock (the engine's runs ahead)
    mgr = manager(directory) if directory else None
    t0, saves, evals, marks = None, 0, [], []
    for i in range(1, args.steps + 1):
        state, metrics = step_fn(state, next(it))
        if i % args.warmup == 0:  # a mark, as the flow's listener takes it (`flow`)
            jax.block_until_ready(metrics)
            marks.append((i, time.perf_counter()))
            t0 = t0 or marks[-1][1]
        if i % args.checkpoint_every == 0 or i == args.steps:
            if mgr is not None:
                mgr.save(i, args=save_args(state, it))
                saves += 1
            evals.append(evaluate(eval_fn, state, program))
    if mgr is not None:
        mgr.wait_until_finished()
    jax.block_until_ready(state)
    t_end = time.perf_counter()
    if mgr is not None:
        mgr.close()
    return {
        "loop_s": t_end - t0,
        "saves": saves,
        "eval": evals[-1],
        "loss": float(metrics["loss"]),
        **timeline(marks, t_end),
    }


def timeline(marks: list[tuple[int, float]], t_end: float) -> dict:
    """Where a side's loop time went: the seconds between marks (each --warmup steps, the device
    synchronised), and from the last mark (the last step) to the side's end (the last save
    committed, the last eval read; for the flow, its run ended too)."""
    t0 = marks[0][1]
    return {
        "marks": [[step, round(t - t0, 4)] for step, t in marks],
        "end_s": t_end - marks[-1][1],
    }


def sync_save_s(program, directory: str) -> float:
    """One synchronous save of a freshly initialised state and iterator (the second of two:
    the first pays Orbax's set-up)."""
    import jax

    state = jax.jit(program.init)(jax.random.key(1))
    it = iter(program.train_data(0).to_iter_dataset(program.read_options))
    next(it)
    jax.block_until_ready(state)
    mgr = manager(directory, asynchronous=False)
    times = []
    for step in (1, 2):
        t = time.perf_counter()
        mgr.save(step, args=save_args(state, it))
        mgr.wait_until_finished()
        times.append(time.perf_counter() - t)
    mgr.close()
    return times[-1]
