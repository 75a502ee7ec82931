"""The flow's cost per checkpoint interval with the Prefect server on cores of its own, against the
same server on the training's cores, in one run: what the issue's per-interval target measures on
a machine where the server has room (a team's server, Prefect Cloud), and what it measures on two
cores that the server shares with training (`run.py` on this project's 2-CPU machines).

One standing `prefect server start` (as `run.py`'s); its threads are pinned in turn to
--server-cores ("apart") and to --train-cores ("shared"), the sides always to --train-cores. Per
round and placement: the plain loop and the flow (`run.py --side plain|prefect_jax`, the same
work as `run.py`'s headline) at each of --intervals checkpoint intervals over --steps steps. The
per-interval cost is the slope of the flow's extra loop time over the plain loop's between the
fewest and the most intervals; loop / plain is read at the fewest. Ratios and slopes are per
round, then the median. Needs 4+ CPUs (the GPU machine lent to a session has 16):

    uv run python benchmarks/server_apart.py --train-cores 0,1 --server-cores 2,3 --out apart.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import side_runner  # noqa: E402  (run.py's sides, run as child processes)
from standing_server import StandingServer  # noqa: E402


def cores(text: str) -> set[int]:
    try:
        chosen = {int(c) for c in text.split(",") if c.strip()}
    except ValueError:
        raise SystemExit(
            f"cores {text!r}: give CPU numbers separated by commas, such as 0,1"
        ) from None
    missing = chosen - os.sched_getaffinity(0)
    if not chosen or missing:
        raise SystemExit(
            f"cores {text!r}: this process may run on CPUs {sorted(os.sched_getaffinity(0))} only"
        )
    return chosen


def pin(server: StandingServer, where: set[int]) -> None:
    """Every thread of the server's processes on `where` (threads it starts later inherit it)."""
    import psutil

    root = psutil.Process(server.proc.pid)
    for proc in [root, *root.children(recursive=True)]:
        for thread in proc.threads():
            try:
                os.sched_setaffinity(thread.id, where)
            except OSError:  # a thread that ended meanwhile
                pass


def summarize(rows: list[dict], intervals: list[int]) -> dict:
    """Per placement: each round's per-interval slope (ms) and loop /
    plain ratio, and their medians."""
    few, many = intervals[0], intervals[-1]
    out: dict = {}
    for where in ("apart", "shared"):
        slopes, ratios, server_ms = [], [], []
        for r in sorted({row["round"] for row in rows}):
            got = {
                (row["intervals"], row["side"]): row
                for row in rows
                if row["round"] == r and row["where"] == where
            }
            try:
                extra = {
                    n: got[(n, "prefect_jax")]["loop_s"] - got[(n, "plain")]["loop_s"]
                    for n in (few, many)
                }
            except (KeyError, TypeError):
                continue
            slopes.append(1000 * (extra[many] - extra[few]) / (many - few))
            ratios.append(got[(few, "prefect_jax")]["loop_s"] / got[(few, "plain")]["loop_s"])
            server_ms.append(
                1000
                * (
                    got[(many, "prefect_jax")]["server_cpu_s"]
                    - got[(few, "prefect_jax")]["server_cpu_s"]
                )
                / (many - few)
            )
        if slopes:
            out[where] = {
                "per_interval_ms": round(statistics.median(slopes), 1),
                "per_round_ms": [round(s, 1) for s in slopes],
                f"loop_over_plain_at_{few}": round(statistics.median(ratios), 3),
                "per_round_ratio": [round(x, 3) for x in ratios],
                "server_cpu_ms_per_interval": round(statistics.median(server_ms), 1),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--train-cores",
        default="0,1",
        help="CPUs for the sides (default 0,1: two, as this project's machines)",
    )
    parser.add_argument("--server-cores", default="2,3", help="CPUs for the server when apart")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument(
        "--intervals",
        default="10,100",
        help="checkpoint intervals over --steps (the fewest and the most give the slope)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "SERVER_APART.json"))
    args = parser.parse_args()
    train, apart = cores(args.train_cores), cores(args.server_cores)
    if train & apart:
        parser.error(
            f"--train-cores {args.train_cores} and --server-cores {args.server_cores} share CPUs: "
            "give disjoint sets"
        )
    intervals = sorted({int(n) for n in args.intervals.split(",")})
    if len(intervals) < 2 or intervals[0] < 1:
        parser.error(
            f"--intervals {args.intervals}: give two or more counts of 1 or more, such as 10,100"
        )
    side_args = argparse.Namespace(steps=args.steps, every=None, dispatch=10)

    work = tempfile.mkdtemp(prefix="server-apart-")
    # The plain loop deletes old steps on one thread, as the engine does: with Orbax's default pool
    # it pays more an interval on a machine of 4+ CPUs (os.cpu_count(), not the pinned
    # cores), which would hide the flow's own cost under the floor's.
    env = dict(
        os.environ,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
        BENCH_PLAIN_DELETION_THREADS="1",
    )
    env.pop("PREFECT_API_URL", None)
    report: dict = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "steps": args.steps,
        "intervals": intervals,
        "train_cores": sorted(train),
        "server_cores": sorted(apart),
        "rows": [],
    }
    os.sched_setaffinity(
        0, train
    )  # this process and every side it starts; the server is pinned per placement
    with StandingServer(os.path.join(work, "server-home")) as server:
        report["machine"] = side_runner.machine()
        env = dict(env, PREFECT_API_URL=server.url, PREFECT_HOME=os.path.join(work, "client-home"))
        from goodput_jobs import warm_up

        warm_up(env)
        for r in range(args.rounds):
            # Alternate which placement goes first: a slow minute on a shared machine hits both.
            for where in ("apart", "shared") if r % 2 == 0 else ("shared", "apart"):
                pin(server, apart if where == "apart" else train)
                server.settle(limit_s=10.0)
                for n in intervals:
                    for name in ("plain", "prefect_jax"):
                        before = server.cpu_s()
                        res = side_runner.side(
                            name,
                            side_args,
                            env,
                            every=max(1, args.steps // n),
                            label=f"{name} x{n}, server {where}, round {r + 1}/{args.rounds}",
                        )
                        server.settle(limit_s=10.0)
                        row = {"round": r, "where": where, "intervals": n, "side": name}
                        if res is not None:
                            row.update(
                                {
                                    k: res[k]
                                    for k in ("loop_s", "wall_s", "cpu_s", "process_s")
                                    if k in res
                                },
                                server_cpu_s=server.cpu_s() - before,
                            )
                        report["rows"].append(row)
                        report["summary"] = summarize(report["rows"], intervals)
                        with open(
                            args.out, "w"
                        ) as f:  # after every side: a cut-off run keeps what it measured
                            json.dump(report, f, indent=1)
    print(json.dumps(report["summary"]), flush=True)


if __name__ == "__main__":
    main()
