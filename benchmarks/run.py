"""prefect-jax against its peers, in one run: writes BENCHMARKS.md and prints one JSON line.

The work (the issue's): a 64-256-256-10 MLP on scikit-learn digits, batch 128, --steps steps
(2000), an asynchronous checkpoint and a full evaluation every --every steps (200). Systems,
each in its own fresh Python process, one after the other:

- ``plain``: a hand-written JAX + optax + Orbax loop (jit per step): the floor;
- ``plain_scan``: the same loop running --dispatch steps per jitted ``lax.scan``;
- ``plain_tasks`` (`floor.py`'s, not in this run): the plain loop with each interval's steps and
  save in one Prefect task run and its evaluation in another, in a flow run, nothing else of
  prefect-jax: the floor Prefect's task runs set under the per-interval targets;
- ``prefect_jax``: the `train_and_evaluate` flow against a standing ``prefect server``
  (started once, before any clock), one step per dispatch, and with ``steps_per_dispatch``;
- ``prefect_jax_ephemeral``: the flow with no API URL (Prefect's ephemeral mode starts its own
  server inside the run, and that start counts);
- ``keras``: Keras 3 ``fit`` + ``BackupAndRestore`` on the JAX backend (`keras_peer.py`;
  needs the ``bench`` dependency group).

Clocks (every side): ``wall_s`` runs from after the shared imports (jax, flax, optax, orbax,
grain, the program; for the flow also prefect_jax.flows, so prefect) to the end, the last
checkpoint committed; it includes the flow's Prefect calls and MLflow records (its MLflow
worker process is started before the shared imports, where a flow run starts it: before its
restore task imports JAX and the rest; MLflow imports there meanwhile, on the other core).
``loop_s`` runs from the end of the first training step (its compile excluded) to the same
end: the steps, the checkpoints, the evaluations and, for the flow, every task run, state
change, artifact, event and MLflow write between them. ``train_s`` runs
from the same start to the end of the last training step (before the last checkpoint and
evaluation, and, for the flow, before its end): with one interval, training speed alone.

Then: the orchestration cost per checkpoint interval (the flow against the plain loop at 1
to 100 intervals over the same steps), goodput under preemption (`goodput.py`), the restart
from a checkpoint (`restart.py`), reruns of a deployment through a process worker and the
rerun automation (`worker_rerun.py`), two JAX processes against one (`multiprocess.py`) and the
checkpoint cost against state size (`storage.py --scale`). Every side's whole process (`process_s`),
peak RSS and the standing server's CPU time meanwhile are recorded too. ``--baseline DIR`` also runs
the flow from another checkout of prefect_jax (e.g. an older commit) for a before/after table;
``--render JSON`` rewrites the report from the raw results of an earlier run (``BENCHMARKS.json``,
written beside the report). ``--profile DIR`` also runs the flow side (and the baseline) once more
under pyinstrument and writes the profiles there (those runs are not in the tables).

    uv run --group bench python benchmarks/run.py               # the full run, goodput most of it
    uv run --group bench python benchmarks/run.py --no-goodput  # without the preemption runs
    uv run --group bench python benchmarks/run.py --quick       # a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from standing_server import StandingServer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.dont_write_bytecode = False  # as tests/bytecode_cache.py, for this process and its sides:
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # every side loads .pyc files, none compiles


def log(msg: str) -> None:
    print(f"[run] {msg}", file=sys.stderr, flush=True)


# -- the sides (each runs in a child process: `run.py --side NAME`) ------------------------------


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


# -- the parent --------------------------------------------------------------------------------


def run_child(cmd: list[str], env: dict, name: str) -> dict | None:
    """Run a child; its last stdout line is its JSON result, to which this adds ``process_s`` (the
    whole process, from its start to its exit: interpreter, imports, work, teardown) and
    ``peak_rss_mib`` (its peak resident memory, from the kernel's rusage) and ``cpu_s`` (its user
    and system CPU time, with that of the children it waited for, such as its MLflow worker)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        process_s = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        log(f"{name} FAILED (exit {proc.returncode}):\n{stderr[-3000:]}")
        return None
    result = json.loads(lines[-1])
    result.update(
        process_s=process_s,
        peak_rss_mib=usage.ru_maxrss / 1024,
        cpu_s=usage.ru_utime + usage.ru_stime,
    )
    log(
        f"{name} ({process_s:.0f}s): "
        + ", ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
            for k, v in result.items()
            if not isinstance(v, (dict, list))
        )
    )
    return result


def run_cli(args, env: dict, label: str = "cli", exports: bool = False) -> dict | None:
    """The user's command, `prefect-jax run`, as its own process on the same work: timed whole, as
    a person or a worker runs it. No exporters (the other sides export nothing), or with
    `exports` its defaults (latest, best, final: each export a version of an MLflow registered
    model), as a user who sets none runs it."""
    workdir = tempfile.mkdtemp(prefix="bench-cli-")
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "prefect-jax"),
        "run",
        "--program",
        "bench_programs:mlp",
        "--job",
        "bench",
        "--storage",
        workdir,
        "--max-steps",
        str(args.steps),
        "--checkpoint-every-steps",
        str(args.every),
        *([] if exports else ["--exporters"]),
        "--mlflow-tracking-uri",
        f"sqlite:///{workdir}/mlflow.db",
        "--json",
        "--no-progress",
    ]
    try:
        return run_child(
            cmd,
            dict(env, PYTHONPATH=os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH")]))),
            label,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def side(
    name: str,
    args,
    env: dict,
    steps: int | None = None,
    every: int | None = None,
    label: str | None = None,
    profile: str | None = None,
) -> dict | None:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--side",
        name,
        "--steps",
        str(steps or args.steps),
        "--every",
        str(every or args.every),
        "--dispatch",
        str(args.dispatch),
    ]
    if profile:
        cmd += ["--profile", profile]
    return run_child(cmd, env, label or name)


def median_results(rounds: list[dict]) -> dict:
    """Per side, the median of each number over the rounds it finished (None: it failed in all);
    what is not a number (the final eval, the code's folder) from its first finished round."""
    import statistics

    out: dict = {}
    for name in rounds[0]:
        done = [r[name] for r in rounds if r.get(name)]
        if not done:
            out[name] = None
            continue
        merged = dict(done[0])
        for key, value in done[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = statistics.median(
                    d[key] for d in done if isinstance(d.get(key), (int, float))
                )
        out[name] = merged
    return out


@contextlib.contextmanager
def sides_server(prefix: str):
    """One standing server for a script that drives this file's sides (`thread_cpu.py`,
    `floor.py`): yields (server, env, machine), env naming the server, after a first flow run."""
    from goodput import warm_up

    work = tempfile.mkdtemp(prefix=prefix)
    env = dict(
        os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING"
    )
    env.pop("PREFECT_API_URL", None)
    with StandingServer(os.path.join(work, "server-home")) as server:
        env = dict(env, PREFECT_API_URL=server.url, PREFECT_HOME=os.path.join(work, "client-home"))
        warm_up(env)
        yield server, env, machine()


def sides_parser(description: str, rounds: int) -> argparse.ArgumentParser:
    """The options of a script that drives this file's sides at two interval counts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument(
        "--intervals",
        default="10,100",
        help="two interval counts over --steps: the slope between them is per interval",
    )
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser


def interval_counts(parser: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    """`--intervals` as two counts, the second larger: the slope between them is per interval."""
    few, many = sorted(int(n) for n in text.split(","))
    if few < 1 or many <= few:
        parser.error(f"--intervals {text}: give two counts, the second larger, such as 10,100")
    return few, many


def machine() -> dict:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gib": round(mem, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "devices": str(jax.devices()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument(
        "--every", type=int, default=200, help="checkpoint + full eval every N steps"
    )
    parser.add_argument(
        "--dispatch", type=int, default=10, help="steps per dispatch of the scan sides"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test: fewer steps, sizes and intervals"
    )
    parser.add_argument(
        "--out",
        default=os.path.join(ROOT, "BENCHMARKS.md"),
        help="the report (default BENCHMARKS.md)",
    )
    parser.add_argument(
        "--baseline", help="a checkout of prefect_jax to run as 'before' (e.g. a git worktree)"
    )
    parser.add_argument("--profile", help="a folder for pyinstrument profiles of the flow side")
    parser.add_argument(
        "--render", metavar="JSON", help="only rewrite --out from the raw results of an earlier run"
    )
    parser.add_argument(
        "--no-goodput",
        action="store_true",
        help="skip the goodput-under-preemption runs (goodput.py, ~45 min)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds of the headline sides and of the sweep "
        "(default 3, 1 with --quick); a ratio is the median of its per-round ratios",
    )
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.render:
        with open(args.render) as f:
            write_report(json.load(f), args.out)
        return

    if args.side:
        if os.environ.get(
            "BENCH_THREAD_CPU"
        ):  # benchmarks/thread_cpu.py: this side's CPU by thread
            from thread_cpu import install

            install(os.environ["BENCH_THREAD_CPU"])
        with tempfile.TemporaryDirectory(prefix=f"bench-{args.side}-") as workdir:
            print(json.dumps(SIDES[args.side](args, workdir)), flush=True)
        return

    if args.quick:
        args.steps, args.every = 400, 100
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    work = tempfile.mkdtemp(prefix="prefect-jax-bench-")
    base_env = dict(
        os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING"
    )
    base_env.pop("PREFECT_API_URL", None)
    report: dict = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "steps": args.steps,
        "every": args.every,
        "dispatch": args.dispatch,
        "machine": machine(),
    }
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    t_all = time.perf_counter()
    with StandingServer(os.path.join(work, "server-home")) as server:
        log(f"prefect server up at {server.url} in {server.start_s:.1f}s (not counted)")
        report["server_start_s"] = server.start_s
        env = dict(
            base_env, PREFECT_API_URL=server.url, PREFECT_HOME=os.path.join(work, "client-home")
        )
        from goodput import warm_up

        warm_up(
            env
        )  # a first flow run, not measured: the server registers the flow, the client its profile
        peers = {}

        def with_server_cpu(run):
            """The server's CPU seconds for a side (same two cores): while it ran, and until the
            server is idle again (it records a flow run's last events after the run ends)."""
            before = server.cpu_s()
            result = run()
            server.settle(limit_s=10.0)
            if result is not None:
                result["server_cpu_s"] = server.cpu_s() - before
                # Still busy after 10 s: its reading holds work that is not the side's.
                if not server.settled:
                    result["server_busy_after_s"] = round(server.settle_s, 1)
                    log(
                        f"the server was still busy {server.settle_s:.0f} s after that side: "
                        "its server CPU includes other work"
                    )
            return result

        before_env = dict(env, PYTHONPATH=os.path.abspath(args.baseline)) if args.baseline else None
        # The headline sides, in interleaved rounds: a slow minute on these shared cores hits one
        # round of every side, not every round of one side (ratios are medians of per-round ratios).
        headline = [
            "plain",
            "plain_scan",
            "prefect_jax",
            "prefect_jax_scan",
            "cli",
            "cli_exports",
            "keras",
        ] + (["before"] if before_env else [])

        def run_headline(name: str, label: str) -> dict | None:
            if name == "keras":  # no standing server in its process
                return side("keras", args, env, label=label)
            if name == "before":
                return side("prefect_jax", args, before_env, label=label)
            if name in ("cli", "cli_exports"):
                return with_server_cpu(
                    lambda: run_cli(args, env, label=label, exports=name == "cli_exports")
                )
            return with_server_cpu(lambda: side(name, args, env, label=label))

        def in_round(r: int) -> str:
            return f", round {r + 1}/{args.rounds}" if args.rounds > 1 else ""

        rounds = [
            {name: run_headline(name, name + in_round(r)) for name in headline}
            for r in range(args.rounds)
        ]
        report["rounds"] = rounds
        peers.update(median_results(rounds))
        if (
            args.profile
        ):  # extra runs: a profiler slows what it watches, so these are not in the tables
            side(
                "prefect_jax",
                args,
                env,
                label="prefect_jax, profiled",
                profile=os.path.join(args.profile, "after.txt"),
            )
            if before_env:
                side(
                    "prefect_jax",
                    args,
                    before_env,
                    label="before, profiled",
                    profile=os.path.join(args.profile, "before.txt"),
                )
        ephemeral_env = dict(
            base_env,
            PREFECT_HOME=os.path.join(work, "ephemeral-home"),
            PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
            PREFECT_SERVER_ALLOW_EPHEMERAL_MODE="true",
        )
        peers["prefect_jax_ephemeral"] = side("prefect_jax_ephemeral", args, ephemeral_env)
        peers["cli_embedded"] = run_cli(args, ephemeral_env, label="cli, embedded server")
        if args.baseline:
            peers["before_cli_embedded"] = run_cli(
                args,
                dict(ephemeral_env, PYTHONPATH=os.path.abspath(args.baseline)),
                label="before: cli, embedded server",
            )
        report["peers"] = peers

        intervals = [1, 10, 40] if args.quick else [1, 10, 50, 100]
        sweeps = []
        for r in range(args.rounds):
            sweep = []
            for n in intervals:
                every = max(1, args.steps // n)
                row = {"intervals": n, "every": every}
                # One interval is training speed itself: there the scan
                # sides run too (steps_per_dispatch).
                for name in ("plain", "prefect_jax") + (
                    ("plain_scan", "prefect_jax_scan") if n == 1 else ()
                ):
                    res = with_server_cpu(
                        functools.partial(
                            side, name, args, env, every=every, label=f"{name} x{n}{in_round(r)}"
                        )
                    )
                    row[name] = res and {
                        k: res[k]
                        for k in (
                            "wall_s",
                            "loop_s",
                            "train_s",
                            "engine_s",
                            "mlflow_s",
                            "prefect_s",
                            "cpu_s",
                            "server_cpu_s",
                        )
                        if k in res
                    }
                sweep.append(row)
            sweeps.append(sweep)
        report["interval_rounds"] = sweeps
        # The table's rows: each side's median over the rounds (the targets
        # use per-round slopes and ratios).
        report["intervals"] = [
            {
                "intervals": row["intervals"],
                "every": row["every"],
                **median_results(
                    [
                        {k: v for k, v in sw[i].items() if k not in ("intervals", "every")}
                        for sw in sweeps
                    ]
                ),
            }
            for i, row in enumerate(sweeps[0])
        ]

    if not args.no_goodput:
        goodput_cmd = [sys.executable, os.path.join(HERE, "goodput.py")] + (
            ["--periods", "10", "--steps", "1500", "--every", "250"] if args.quick else []
        )
        report["goodput"] = run_child(goodput_cmd, base_env, "goodput")
    restart_cmd = [
        sys.executable,
        os.path.join(HERE, "restart.py"),
        "--program",
        "bench_programs:mlp",
    ]
    report["restart"] = run_child(restart_cmd, dict(base_env, PYTHONPATH=HERE), "restart")
    worker_cmd = [sys.executable, os.path.join(HERE, "worker_rerun.py")] + (
        ["--kills", "2"] if args.quick else []
    )
    report["worker_rerun"] = run_child(worker_cmd, base_env, "worker rerun")
    # A smoke run's numbers stay out of the committed record (benchmarks/MULTIPROCESS.json).
    multiprocess_cmd = [sys.executable, os.path.join(HERE, "multiprocess.py")] + (
        ["--steps", "600", "--rounds", "1", "--out", os.path.join(work, "multiprocess.json")]
        if args.quick
        else []
    )
    report["multiprocess"] = run_child(multiprocess_cmd, base_env, "multiprocess")
    server_cost_cmd = [sys.executable, os.path.join(HERE, "server_cost.py")] + (
        ["--repeats", "1"] if args.quick else []
    )
    report["server_cost"] = run_child(server_cost_cmd, base_env, "server cost")
    sizes = "1,16,64" if args.quick else "1,16,64,256,512,1024"
    report["storage"] = run_child(
        [sys.executable, os.path.join(HERE, "storage.py"), "--scale", "--sizes", sizes],
        base_env,
        "storage scale",
    )
    report["total_s"] = time.perf_counter() - t_all
    shutil.rmtree(work, ignore_errors=True)

    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(report, f, indent=1)
    write_report(report, args.out)


def write_report(report: dict, out: str) -> None:
    """BENCHMARKS.md from the raw results (also kept, as BENCHMARKS.json), and the JSON line."""
    sys.path.insert(0, HERE)
    from report import summarize, write_markdown

    summary = summarize(report)
    with open(out, "w") as f:
        f.write(write_markdown(report, summary))
    log(f"wrote {out} ({report['total_s']:.0f}s)")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
