"""Where the flow's CPU goes per checkpoint interval, by thread: the plain loop and the flow
(`run.py --side plain|prefect_jax`, the headline's work) at two interval counts over the same
steps, against one standing `prefect server` (as `run.py`'s), in alternated rounds. Each side's
process records the CPU time of each of its Python threads by name (a thread's own clock, read as
it ends or as the process exits), the rest of the process (XLA's and other native threads), and
its child processes' (the flow's MLflow worker); the server's CPU is read around each side. Per
interval is the slope between the two counts, per round, then the median over rounds.

    uv run --group bench python benchmarks/thread_cpu.py [--intervals 10,100] [--rounds 2]
        [--out benchmarks/THREAD_CPU.json]

CPU time, not wall time: on two cores shared with the server, the flow's loop time per interval
depends on how this CPU overlaps (`run.py`'s sweep measures that). A side records itself when
`BENCH_THREAD_CPU` names a file (`install`, called by `run.py --side`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# Threads that Orbax, Prefect and this package start by the hundred
# get numbered names: one row each.
_NUMBERED = re.compile(r"[-_ ]?\(?\d+\)?")


def thread_kind(name: str) -> str:
    return _NUMBERED.sub("#", name)


def install(path: str) -> None:
    """Record this process's CPU time by thread kind into `path` (JSON) at exit."""
    import atexit

    ended: collections.Counter = collections.Counter()
    lock = threading.Lock()
    run = threading.Thread.run

    def timed_run(self, *args, **kwargs):
        try:
            return run(self, *args, **kwargs)
        finally:
            with lock:
                ended[thread_kind(self.name)] += time.thread_time()

    threading.Thread.run = timed_run

    def dump() -> None:
        import psutil

        cpu = collections.Counter(ended)
        for thread in threading.enumerate():
            if (
                thread is not threading.current_thread()
                and thread.ident is not None
                and thread.is_alive()
            ):
                try:
                    cpu[thread_kind(thread.name)] += time.clock_gettime(
                        time.pthread_getcpuclockid(thread.ident)
                    )
                except (OSError, ValueError):  # it ended meanwhile
                    pass
        cpu["MainThread"] = time.thread_time()
        own = os.times()
        process = own.user + own.system
        children = own.children_user + own.children_system  # (those that ended and were waited for)
        for child in psutil.Process().children(recursive=True):
            try:
                t = child.cpu_times()
                children += t.user + t.system
            except psutil.Error:
                pass
        with open(path, "w") as f:
            json.dump(
                {
                    "threads": dict(cpu),
                    "process": process,
                    "native": process - sum(cpu.values()),
                    "children": children,
                },
                f,
            )

    atexit.register(dump)


def rows_of(record: dict) -> dict[str, float]:
    """One side's CPU seconds by row: each thread kind, the native rest, the child processes."""
    out = {f"thread {k}": v for k, v in record["threads"].items()}
    out["native threads (XLA, ...)"] = record["native"]
    out["child processes (the MLflow worker)"] = record["children"]
    out["the process, in all"] = record["process"]
    return out


def main() -> None:
    sys.path.insert(0, HERE)
    import side_runner  # run.py's sides, run as child processes, and their standing server

    parser = side_runner.sides_parser(__doc__.splitlines()[0], rounds=2)
    parser.add_argument(
        "--sides",
        default="plain,prefect_jax",
        help="two of run.py's sides, the floor first (plain_tasks: floor.py's); "
        "BENCHMARKS.md renders plain,prefect_jax only",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "THREAD_CPU.json"))
    args = parser.parse_args()
    few, many = side_runner.interval_counts(parser, args.intervals)
    sides = tuple(args.sides.split(","))
    if len(sides) != 2 or not set(sides) <= {"plain", "plain_tasks", "prefect_jax"}:
        parser.error(
            f"--sides {args.sides}: give two of plain, plain_tasks, prefect_jax, the floor first"
        )
    side_args = argparse.Namespace(steps=args.steps, every=None, dispatch=10)
    work = tempfile.mkdtemp(prefix="thread-cpu-")  # each side's record
    report: dict = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "steps": args.steps,
        "intervals": [few, many],
        "sides": list(sides),
        "rounds": [],
    }
    with side_runner.sides_server("thread-cpu-server-") as (server, env, machine):
        report["machine"] = machine
        for r in range(args.rounds):
            got: dict = {}
            for name in sides if r % 2 == 0 else sides[::-1]:
                for n in (few, many):
                    path = os.path.join(work, f"{name}-{n}-{r}.json")
                    before = server.cpu_s()
                    res = side_runner.side(
                        name,
                        side_args,
                        dict(env, BENCH_THREAD_CPU=path),
                        every=max(1, args.steps // n),
                        label=f"{name} x{n}, round {r + 1}/{args.rounds}",
                    )
                    server.settle(limit_s=10.0)
                    if res is None or not os.path.exists(path):
                        continue
                    with open(path) as f:
                        cpu = rows_of(json.load(f))
                    cpu["the Prefect server"] = server.cpu_s() - before
                    got[(name, n)] = {"cpu": cpu, "loop_s": res.get("loop_s")}
            per: dict = {}
            for name in sides:
                a, b = got.get((name, few)), got.get((name, many))
                if a and b:
                    per[name] = {
                        k: round(
                            1000 * (b["cpu"].get(k, 0.0) - a["cpu"].get(k, 0.0)) / (many - few), 2
                        )
                        for k in set(a["cpu"]) | set(b["cpu"])
                    }
                    per[name]["loop time"] = round(
                        1000 * (b["loop_s"] - a["loop_s"]) / (many - few), 2
                    )
            report["rounds"].append(per)
            report["per_interval_ms"] = {
                name: {
                    k: statistics.median(
                        p[name][k] for p in report["rounds"] if name in p and k in p[name]
                    )
                    for k in set().union(*(p[name] for p in report["rounds"] if name in p))
                }
                for name in sides
                if any(name in p for p in report["rounds"])
            }
            with open(
                args.out, "w"
            ) as f:  # after every round: a cut-off run keeps what it measured
                json.dump(report, f, indent=1)
    print(json.dumps(report.get("per_interval_ms")), flush=True)


if __name__ == "__main__":
    main()
