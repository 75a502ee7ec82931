"""The goodput harness's peers, each a child process (`goodput.py --child NAME`): the plain
JAX + optax + Orbax loop (also as `floor.py`'s ``plain_prefect`` and ``plain_flow``) and Keras 3
``fit`` with ``BackupAndRestore``, on `bench_programs:wide`. The byte LM's peers are in
`goodput_lm.py`.

Each peer writes a line to ``<workdir>/attempts.jsonl`` when it started, finished importing,
restored (and at which step) and ran its first step (`mark`); the harness sums start-up, restore
and compile from those (`goodput_jobs.breakdown`).
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HIDDEN, BATCH = (1024, 1024), 256  # bench_programs.wide


def process_start() -> float:
    sys.path.insert(0, os.path.dirname(HERE))
    from prefect_jax.training.goodput import process_start_time  # imports neither jax nor prefect

    return process_start_time()


def mark(workdir: str, **fields) -> None:
    """One line per event of this process in <workdir>/attempts.jsonl (peers only)."""
    with open(os.path.join(workdir, "attempts.jsonl"), "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "t": time.time(), **fields}) + "\n")


def use_compile_cache(workdir: str) -> None:
    """JAX's persistent compilation cache in `workdir`, every program cached (as the others'
    ``--compilation-cache job``)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "compile-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def child_plain(args) -> None:
    """The plain loop. For `floor.py`'s rerun floor, as ``plain_prefect`` it imports Prefect
    first, as the command does (its flows, before the program), with the garbage collector off
    for that import only (the command keeps it off through all its imports, then freezes them),
    and does nothing with it; as ``plain_flow`` it runs in a Prefect flow run that imports Prefect
    first and splits the work into task runs as `train_and_evaluate` does (the restore in one,
    each interval's steps and save in one, its evaluation in another), nothing else of
    prefect-jax."""
    mark(args.workdir, event="start", process_start=process_start())
    in_flow = args.child == "plain_flow"
    if args.child == "plain_prefect":
        import gc

        gc.disable()
        import prefect  # noqa: F401

        gc.enable()
    if in_flow:  # as the command, which imports Prefect (its flows) before the program
        from prefect import flow, task
        from prefect.cache_policies import NO_CACHE
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    sys.path.insert(0, HERE)
    from bench_programs import wide as program

    use_compile_cache(args.workdir)
    mark(args.workdir, event="imported")
    train_step, eval_step = (
        jax.jit(program.train_step, donate_argnums=(0,)),
        jax.jit(program.eval_step),
    )  # as the engine
    data = program.train_data(0)  # a random-access dataset: batch i is data[i]
    manager = ocp.CheckpointManager(
        os.path.join(args.workdir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True),
    )

    is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731

    def savable(tree):  # typed PRNG keys are stored as their raw key data
        return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)

    live: dict = {"first": True}  # the state, and whether the first step is still to come

    def restore() -> int:
        step = manager.latest_step()
        if step is None:
            live["state"], step = jax.jit(program.init)(jax.random.key(0)), 0
        else:
            typed = jax.eval_shape(program.init, jax.random.key(0))
            raw = manager.restore(
                step,
                args=ocp.args.StandardRestore(
                    jax.eval_shape(lambda k: savable(program.init(k)), jax.random.key(0))
                ),
            )
            live["state"] = jax.tree.map(
                lambda t, x: jax.random.wrap_key_data(x) if is_key(t) else x, typed, raw
            )
        mark(args.workdir, event="restored", step=int(step))
        return int(step)

    def evaluate(step: int) -> dict:
        totals: dict = {}
        for batch in program.eval_data():
            for name, pair in jax.device_get(eval_step(live["state"], batch)).items():
                totals[name] = totals.get(name, 0) + np.asarray(pair, np.float64)
        return {name: float(s / n) for name, (s, n) in totals.items()}

    def interval(step: int) -> int:
        """The steps from `step` to the next checkpoint (or the end), then the save."""
        while True:
            live["state"], _ = train_step(live["state"], data[step])
            step += 1
            if live["first"]:
                jax.block_until_ready(live["state"])
                mark(args.workdir, event="first_step")
                live["first"] = False
            if step % args.every == 0 or step == args.steps:
                manager.save(step, args=ocp.args.StandardSave(savable(live["state"])), force=True)
                return step

    def job() -> int:
        step = restore()
        while step < args.steps:
            step = interval(step)
            evaluate(step)
        manager.wait_until_finished()
        return step

    if in_flow:
        restore = task(restore, name="restore_or_init", cache_policy=NO_CACHE)
        interval = task(
            interval,
            name="train_until_checkpoint",
            task_run_name="train {step}",
            cache_policy=NO_CACHE,
        )
        evaluate = task(
            evaluate, name="evaluate_if_new", task_run_name="evaluate {step}", cache_policy=NO_CACHE
        )
        step = flow(name="plain-in-task-runs")(job)()
    else:
        step = job()
    manager.close()
    mark(args.workdir, event="done", step=step)


def child_keras(args) -> None:
    mark(args.workdir, event="start", process_start=process_start())
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import numpy as np

    from prefect_jax.examples.digits import load_digits_split

    use_compile_cache(args.workdir)
    mark(args.workdir, event="imported")
    x_train, y_train, x_test, y_test = load_digits_split()
    rng = np.random.default_rng(0)
    n = args.every * BATCH
    idx = np.concatenate([rng.permutation(len(x_train)) for _ in range(-(-n // len(x_train)))])[:n]
    x, y = x_train[idx], y_train[idx]
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(HIDDEN[0], activation="relu"),
            keras.layers.Dense(HIDDEN[1], activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    workdir = args.workdir

    class Marks(keras.callbacks.Callback):
        first = True

        def on_train_begin(self, logs=None):  # BackupAndRestore (listed before) has restored by now
            mark(workdir, event="restored", step=int(self.model.optimizer.iterations))

        def on_train_batch_end(self, batch, logs=None):
            if self.first:
                mark(workdir, event="first_step")
                self.first = False

    backup = keras.callbacks.BackupAndRestore(
        backup_dir=os.path.join(workdir, "backup"), save_freq="epoch", delete_checkpoint=False
    )
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=args.steps // args.every,
        shuffle=False,
        validation_data=(x_test, y_test),
        validation_batch_size=360,
        callbacks=[backup, Marks()],
        verbose=0,
    )
    mark(workdir, event="done", step=int(model.optimizer.iterations))
