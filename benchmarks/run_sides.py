"""`run.py`'s sides, each the work of one child process (`run.py --side NAME`): the plain JAX +
optax + Orbax loop (``plain``, ``plain_scan``, ``plain_tasks``), the `train_and_evaluate` flow
(``prefect_jax``, ``prefect_jax_scan``, ``prefect_jax_ephemeral``) and Keras 3 ``fit``
(``keras``). Each returns its clocks as a dict (the clocks: `run.py`'s docstring); the parent
adds the whole process's time, memory and CPU (`side_runner.run_child`).
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def import_jax_stack():
    """The imports every side shares, done before its clock starts."""
    import flax.nnx  # noqa: F401
    import grain  # noqa: F401
    import jax
    import optax  # noqa: F401
    import orbax.checkpoint  # noqa: F401

    import prefect_jax.examples.digits  # noqa: F401

    jax.devices()


def deletion_threads() -> dict:
    """Orbax's defaults, as a user writing the loop keeps them, unless BENCH_PLAIN_DELETION_THREADS
    is set (`server_apart.py`: 1, as the engine, which on a machine of 4+ CPUs makes an interval
    quicker: see its `num_deletion_threads`)."""
    threads = os.environ.get("BENCH_PLAIN_DELETION_THREADS")
    return {"num_deletion_threads": int(threads)} if threads else {}


def run_plain(args, workdir: str) -> dict:
    """The floor: jit(train_step) (or a jitted lax.scan of --dispatch steps), the program's Grain
    pipeline, an async Orbax CheckpointManager, a full eval every --every steps."""
    t_import = time.perf_counter()
    if args.side == "plain_tasks":  # before the clock, as the flow side imports prefect_jax.flows
        from prefect import flow, task
        from prefect.cache_policies import NO_CACHE

        import prefect_jax.flows  # noqa: F401
    import_jax_stack()
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    sys.path.insert(0, HERE)
    from bench_programs import mlp as program

    k = args.dispatch if args.side == "plain_scan" else 1
    t0 = time.perf_counter()
    donate = (0,)  # the state, as the engine donates it

    def scan(state, batches):
        return jax.lax.scan(program.train_step, state, batches)

    train_step = jax.jit(program.train_step if k == 1 else scan, donate_argnums=donate)
    eval_step = jax.jit(program.eval_step)
    state = program.init(jax.random.key(0))
    batches = iter(
        program.train_data(0).to_iter_dataset(program.read_options)
    )  # as the trainer reads it
    manager = ocp.CheckpointManager(
        os.path.join(workdir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=3, enable_async_checkpointing=True, **deletion_threads()
        ),
    )

    def evaluate(state) -> dict:
        totals: dict = {}
        for batch in program.eval_data():
            for name, pair in jax.device_get(eval_step(state, batch)).items():
                totals[name] = totals.get(name, 0) + np.asarray(pair, np.float64)
        return {name: float(s / n) for name, (s, n) in totals.items()}

    def savable(state):  # typed PRNG keys are not savable as is: store their raw key data
        is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
        return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, state)

    clock = {"loop": None, "trained": None}

    def interval(step: int) -> int:
        """The steps from `step` to the next checkpoint (or the end), then the save."""
        nonlocal state
        while True:
            if k == 1:
                state, metrics = train_step(state, next(batches))
                step += 1
            else:
                n = min(k, args.every - step % args.every)
                chunk = [next(batches) for _ in range(n)]
                state, metrics = train_step(state, jax.tree.map(lambda *xs: np.stack(xs), *chunk))
                step += n
            if clock["loop"] is None:
                jax.block_until_ready(state)
                clock["loop"] = time.perf_counter()
            if step == args.steps:  # the last step's end (the save below would wait for it anyway)
                jax.block_until_ready(state)
                clock["trained"] = time.perf_counter()
            if step % args.every == 0 or step == args.steps:
                manager.save(step, args=ocp.args.StandardSave(savable(state)), force=True)
                return step

    def intervals(train=interval, evaluation=lambda step: evaluate(state)) -> dict:
        step, result = 0, {}
        while step < args.steps:
            step = train(step)
            result = evaluation(step)
        manager.wait_until_finished()
        return result

    if (
        args.side == "plain_tasks"
    ):  # each interval's steps and save in one task run, its evaluation in another
        train_task = task(
            interval,
            name="train_until_checkpoint",
            task_run_name="train {step}",
            cache_policy=NO_CACHE,
        )
        eval_task = task(
            lambda step: evaluate(state),
            name="evaluate_if_new",
            task_run_name="evaluate {step}",
            cache_policy=NO_CACHE,
        )
        in_task_runs = flow(name="plain-in-task-runs")(lambda: intervals(train_task, eval_task))
        result = in_task_runs()
    else:
        result = intervals()
    t_loop, t_trained = clock["loop"], clock["trained"]
    manager.close()
    t_end = time.perf_counter()
    return {
        "wall_s": t_end - t0,
        "loop_s": t_end - t_loop,
        "train_s": t_trained - t_loop,
        "import_s": t0 - t_import,
        "eval": result,
        "jax": jax.__version__,
        "devices": str(jax.devices()),
    }


def run_prefect_jax(args, workdir: str) -> dict:
    """The `train_and_evaluate` flow, timed from outside: the engine's entry points are wrapped
    (not changed) to find the end of the first step and to split the time spent in the engine,
    in MLflow and (the rest) in Prefect."""
    t_import = time.perf_counter()
    mlflow_uri = f"sqlite:///{workdir}/mlflow.db"
    from prefect_jax.flows import train_and_evaluate

    # Where a deployment's flow run starts its MLflow worker: once Prefect and the flows are
    # imported, its body asks for it (`mlflow_client.warm_up`) before the restore task imports JAX,
    # Orbax, Grain and the program, so MLflow imports and opens its store on the other core
    # meanwhile. This side imports those before its clocks start, so it asks here, before them,
    # not on the training loop, where no flow run or command has it.
    try:
        from prefect_jax.training.mlflow_client import warm_up
    except ImportError:  # an older checkout (--baseline): its tracking module, if it has one
        try:
            from prefect_jax.training.tracking import warm_up
        except ImportError:
            warm_up = None
    if warm_up is None:
        warmed_first = False
    else:
        warm_up(mlflow_uri)
        warmed_first = True
    import_jax_stack()
    import jax

    sys.path.insert(0, HERE)  # for "bench_programs:mlp"
    from prefect_jax.training import tracking
    from prefect_jax.training import trainer as trainer_mod
    from prefect_jax.training.specs import CheckpointSpec, EvalSpec, TrainSpec

    clock: dict = {"engine_s": 0.0, "mlflow_s": 0.0, "first_step_at": None, "trained_at": None}

    def timed(cls, name, key):
        original = getattr(cls, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                clock[key] += time.perf_counter() - t

        setattr(cls, name, wrapper)

    for name in (
        "train_until_checkpoint",
        "evaluate_if_new",
        "export",
        "restore_or_init",
        "finish",
    ):
        timed(trainer_mod.Trainer, name, "engine_s")
    # log_metrics and has_metric_at: the names in older checkouts (--baseline)
    for name in (
        "start",
        "log_new_metrics",
        "log_metrics_once",
        "log_metrics",
        "finish",
        "has_metric_at",
        "set_tags",
        "log_artifacts",
    ):
        if hasattr(tracking.Tracker, name):
            timed(tracking.Tracker, name, "mlflow_s")
    init = trainer_mod.Trainer.__init__

    def init_and_watch_first_step(self, *a, **kw):
        init(self, *a, **kw)
        # The compiled steps live on trainer.loop; older checkouts
        # (--baseline) kept them on the trainer.
        loop = getattr(self, "loop", None)
        steps = (
            [(loop, "train_step"), (loop, "scan_steps")]
            if loop is not None
            else [(self, "_train_step"), (self, "_scan_steps")]
        )
        for owner, attr in steps:
            fn = getattr(owner, attr, None)
            if fn is None:
                continue

            def first(*fa, _fn=fn, **fkw):
                out = _fn(*fa, **fkw)
                if clock["first_step_at"] is None:
                    jax.block_until_ready(out)
                    clock["first_step_at"] = time.perf_counter()
                return out

            first.lower = fn.lower  # the engine's precompile lowers the jitted step itself
            setattr(owner, attr, first)

    trainer_mod.Trainer.__init__ = init_and_watch_first_step
    try:  # where the steps of an interval end (its last step done: the NaN guard read waits for it)
        from prefect_jax.training.loop import Loop
    except ImportError:  # an older checkout (--baseline)
        Loop = None
    if Loop is not None:
        run_steps = Loop.run

        def run_and_watch_last_step(self, *a, **kw):
            interval = run_steps(self, *a, **kw)
            clock["trained_at"] = time.perf_counter()
            return interval

        Loop.run = run_and_watch_last_step
    train = {"max_steps": args.steps, "log_every_steps": 50}
    if args.side == "prefect_jax_scan":
        train["steps_per_dispatch"] = args.dispatch
    profiler = None
    if args.profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
        profiler.start()
    t0 = time.perf_counter()
    summary = train_and_evaluate(
        program="bench_programs:mlp",
        job="bench",
        storage=workdir,
        train_spec=TrainSpec(**train),
        checkpoint_spec=CheckpointSpec(every_steps=args.every, keep_last=3),
        eval_spec=EvalSpec(),
        mlflow_tracking_uri=mlflow_uri,
    )
    t_end = time.perf_counter()
    if profiler is not None:
        profiler.stop()
        with open(args.profile, "w") as f:
            f.write(profiler.output_text(unicode=True, color=False))
    assert summary["final_step"] == args.steps, summary
    loop_s = t_end - clock["first_step_at"]
    train_s = (
        clock["trained_at"] - clock["first_step_at"] if clock["trained_at"] is not None else None
    )
    import prefect_jax

    return {
        "wall_s": t_end - t0,
        "loop_s": loop_s,
        "train_s": train_s,
        "import_s": t0 - t_import,
        "eval": summary["eval"],
        "engine_s": clock["engine_s"],
        "mlflow_s": clock["mlflow_s"],
        "prefect_s": (t_end - t0) - clock["engine_s"],
        "code": os.path.dirname(prefect_jax.__file__),
        "mlflow_warmed_first": warmed_first,
    }


def run_keras(args, workdir: str) -> dict:
    sys.path.insert(0, HERE)
    from keras_peer import run_keras as run

    return run(args.steps, args.every, workdir)


SIDES = {
    "plain": run_plain,
    "plain_scan": run_plain,
    "plain_tasks": run_plain,
    "prefect_jax": run_prefect_jax,
    "prefect_jax_scan": run_prefect_jax,
    "prefect_jax_ephemeral": run_prefect_jax,
    "keras": run_keras,
}
