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
import datetime
import functools
import json
import os
import shutil
import sys
import tempfile
import time

from run_sides import SIDES
from side_runner import log, machine, median_results, run_child, run_cli, side
from standing_server import StandingServer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args() -> argparse.Namespace:
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
        help="skip the goodput-under-preemption runs (goodput.py, ~40 min)",
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
    if args.quick:
        args.steps, args.every = 400, 100
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    return args


def main() -> None:
    args = parse_args()
    if args.render:
        with open(args.render) as f:
            write_report(json.load(f), args.out)
        return
    if args.side:  # a child process: one side's work (`side`)
        if os.environ.get("BENCH_THREAD_CPU"):  # thread_cpu.py: this side's CPU by thread
            from thread_cpu import install

            install(os.environ["BENCH_THREAD_CPU"])
        with tempfile.TemporaryDirectory(prefix=f"bench-{args.side}-") as workdir:
            print(json.dumps(SIDES[args.side](args, workdir)), flush=True)
        return
    report = measure(args)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(report, f, indent=1)
    write_report(report, args.out)


def measure(args) -> dict:
    """Every part of the run, in order (each part's function says what it measures): the raw
    results that BENCHMARKS.json keeps."""
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
        from goodput_jobs import warm_up

        # A first flow run, not measured: the server registers the flow, the client its profile.
        warm_up(env)
        report["rounds"] = headline_rounds(args, env, server)
        peers = median_results(report["rounds"])
        peers.update(ephemeral_sides(args, base_env, work))
        report["peers"] = peers
        report["interval_rounds"] = interval_sweep(args, env, server)
        # The table's rows: each side's median over the rounds (the targets use per-round
        # slopes and ratios).
        report["intervals"] = [
            {
                "intervals": row["intervals"],
                "every": row["every"],
                **median_results(
                    [
                        {k: v for k, v in sweep[i].items() if k not in ("intervals", "every")}
                        for sweep in report["interval_rounds"]
                    ]
                ),
            }
            for i, row in enumerate(report["interval_rounds"][0])
        ]
    report.update(other_benchmarks(args, base_env, work))
    report["total_s"] = time.perf_counter() - t_all
    shutil.rmtree(work, ignore_errors=True)
    return report


def with_server_cpu(server: StandingServer, run) -> dict | None:
    """`run()`'s result with the server's CPU seconds for it (same two cores): while it ran, and
    until the server is idle again (it records a flow run's last events after the run ends)."""
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


def in_round(args, r: int) -> str:
    return f", round {r + 1}/{args.rounds}" if args.rounds > 1 else ""


def headline_rounds(args, env: dict, server: StandingServer) -> list[dict]:
    """The headline sides (the Systems table), in interleaved rounds: a slow minute on these
    shared cores hits one round of every side, not every round of one side (ratios are medians
    of per-round ratios). With --profile, the flow side once more under pyinstrument (a profiler
    slows what it watches, so those runs are not in the tables)."""
    before_env = dict(env, PYTHONPATH=os.path.abspath(args.baseline)) if args.baseline else None
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
            exports = name == "cli_exports"
            return with_server_cpu(server, lambda: run_cli(args, env, label, exports))
        return with_server_cpu(server, lambda: side(name, args, env, label=label))

    rounds = [
        {name: run_headline(name, name + in_round(args, r)) for name in headline}
        for r in range(args.rounds)
    ]
    if args.profile:
        profiled = [("prefect_jax", env, "after.txt"), ("before", before_env, "before.txt")]
        for label, side_env, name in profiled:
            if side_env is not None:
                out = os.path.join(args.profile, name)
                side("prefect_jax", args, side_env, label=f"{label}, profiled", profile=out)
    return rounds


def ephemeral_sides(args, base_env: dict, work: str) -> dict:
    """The flow and the command with no API URL: Prefect's ephemeral mode starts its own server
    inside the run, and that start counts."""
    ephemeral_env = dict(
        base_env,
        PREFECT_HOME=os.path.join(work, "ephemeral-home"),
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
        PREFECT_SERVER_ALLOW_EPHEMERAL_MODE="true",
    )
    sides = {
        "prefect_jax_ephemeral": side("prefect_jax_ephemeral", args, ephemeral_env),
        "cli_embedded": run_cli(args, ephemeral_env, label="cli, embedded server"),
    }
    if args.baseline:
        sides["before_cli_embedded"] = run_cli(
            args,
            dict(ephemeral_env, PYTHONPATH=os.path.abspath(args.baseline)),
            label="before: cli, embedded server",
        )
    return sides


SWEEP_KEYS = (
    "wall_s",
    "loop_s",
    "train_s",
    "engine_s",
    "mlflow_s",
    "prefect_s",
    "cpu_s",
    "server_cpu_s",
)


def interval_sweep(args, env: dict, server: StandingServer) -> list[list[dict]]:
    """The orchestration cost per checkpoint interval: the flow against the plain loop over the
    same steps in 1 to 100 intervals, per round. One interval is training speed itself: there
    the scan sides run too (steps_per_dispatch)."""
    intervals = [1, 10, 40] if args.quick else [1, 10, 50, 100]
    sweeps = []
    for r in range(args.rounds):
        sweep = []
        for n in intervals:
            every = max(1, args.steps // n)
            row = {"intervals": n, "every": every}
            scans = ("plain_scan", "prefect_jax_scan") if n == 1 else ()
            for name in ("plain", "prefect_jax", *scans):
                label = f"{name} x{n}{in_round(args, r)}"
                res = with_server_cpu(
                    server, functools.partial(side, name, args, env, every=every, label=label)
                )
                row[name] = res and {k: res[k] for k in SWEEP_KEYS if k in res}
            sweep.append(row)
        sweeps.append(sweep)
    return sweeps


def other_benchmarks(args, base_env: dict, work: str) -> dict:
    """The other benchmarks, each its own script in a child process (its docstring says what it
    measures): goodput under preemption, the restart, reruns through a process worker, several
    JAX processes, the server's cost and the checkpoint cost against state size."""
    quick = args.quick
    out: dict = {}
    if not args.no_goodput:
        goodput = ["--periods", "10", "--steps", "1500", "--every", "250"] if quick else []
        out["goodput"] = run_child(script("goodput.py", *goodput), base_env, "goodput")
    restart = script("restart.py", "--program", "bench_programs:mlp")
    out["restart"] = run_child(restart, dict(base_env, PYTHONPATH=HERE), "restart")
    worker = script("worker_rerun.py", *(["--kills", "2"] if quick else []))
    out["worker_rerun"] = run_child(worker, base_env, "worker rerun")
    # A smoke run's numbers stay out of the committed record (benchmarks/MULTIPROCESS.json).
    smoke = ["--steps", "600", "--rounds", "1", "--out", os.path.join(work, "multiprocess.json")]
    multiprocess = script("multiprocess.py", *(smoke if quick else []))
    out["multiprocess"] = run_child(multiprocess, base_env, "multiprocess")
    server_cost = script("server_cost.py", *(["--repeats", "1"] if quick else []))
    out["server_cost"] = run_child(server_cost, base_env, "server cost")
    sizes = "1,16,64" if quick else "1,16,64,256,512,1024"
    storage = script("storage.py", "--scale", "--sizes", sizes)
    out["storage"] = run_child(storage, base_env, "storage scale")
    return out


def script(name: str, *args: str) -> list[str]:
    """The command that runs benchmarks/`name` with `args` in this interpreter."""
    return [sys.executable, os.path.join(HERE, name), *args]


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
