"""The floor that Prefect's task runs set under the per-interval and loop targets: the plain loop
(`run.py --side plain`), the same loop with each checkpoint interval split into the two Prefect
task runs a `train_and_evaluate` interval makes (`--side plain_tasks`: the steps and the save in
one, the evaluation in the other, in a flow run, nothing else of prefect-jax), and the flow
(`--side prefect_jax`), at two interval counts over the same steps, against one standing
`prefect server` (as `run.py`'s), in alternated rounds.

Per interval is the slope of each side's loop time (and CPU, its process's and the server's)
between the two counts, per round, then the median over rounds. `plain_tasks` minus `plain` is
what the two task runs cost an interval whatever runs inside them; `prefect_jax` minus
`plain_tasks` is the rest of the flow's cost (its engine, Orbax's three-item save, the NaN guard
read, the eval record, the events, MLflow).

Then the rerun's floor (``--reruns``, 0 to skip): a job of `goodput.py` (``bench_programs:wide``,
its compilation cache) trained to its first checkpoint, then rerun again and again, each rerun
restoring the newest step and training one more, in alternated order: the plain loop
(`goodput.py`'s), the same loop after importing Prefect as the command does (``plain_prefect``:
what any Prefect-run rerun pays before its first step, less its flow run), the same loop as a
Prefect flow run (``plain_flow``: Prefect imported first, the restore, the steps and the
evaluation in task runs, nothing else of prefect-jax) and the ``prefect-jax run``
command. Each rerun's way back is from its process start to its first new step done,
as the goodput runs measure it.

    uv run --group bench python benchmarks/floor.py [--intervals 10,100] [--rounds 3] [--reruns 8]
        [--out benchmarks/FLOOR.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIDES = ("plain", "plain_tasks", "prefect_jax")
RERUN_SYSTEMS = ("plain", "plain_prefect", "plain_flow", "prefect_jax")


def rerun_floor(env: dict, reruns: int, every: int = 500) -> dict:
    """Each system's way back to its first new step over `reruns` reruns (seconds; see the
    module)."""
    import goodput_jobs

    work = {name: tempfile.mkdtemp(prefix=f"floor-rerun-{name}-") for name in RERUN_SYSTEMS}
    args = argparse.Namespace(every=every, steps=every, prefect_jax_args="")

    def run_once(name: str) -> None:
        cmd, child_env = goodput_jobs.command(name, args, work[name], env)
        goodput_jobs.log(f"{name} to step {args.steps}")
        subprocess.run(cmd, env=child_env, check=True, capture_output=True, timeout=600)

    for name in RERUN_SYSTEMS:  # the first checkpoint (and the compilation cache)
        run_once(name)
    for i in range(reruns):
        args.steps = every + 1 + i
        for name in RERUN_SYSTEMS if i % 2 == 0 else RERUN_SYSTEMS[::-1]:
            run_once(name)
    back = {name: goodput_jobs.breakdown(name, work[name])["restart_s"] for name in RERUN_SYSTEMS}
    for d in work.values():
        shutil.rmtree(d, ignore_errors=True)
    out: dict = {
        "reruns": reruns,
        "every": every,
        "way_back_s": back,
        "median_s": {name: round(statistics.median(v), 3) for name, v in back.items() if v},
    }
    plain = out["median_s"].get("plain")
    if plain:
        out["median / plain loop"] = {
            name: round(m / plain, 3) for name, m in out["median_s"].items()
        }
    return out


def per_interval(got: dict, few: int, many: int) -> dict:
    """One round's slopes, ms per interval, by side and measure; and each side's loop time at
    `few` intervals over the plain loop's."""
    out: dict = {}
    for name in SIDES:
        a, b = got.get((name, few)), got.get((name, many))
        if a and b:
            out[name] = {k: round(1000 * (b[k] - a[k]) / (many - few), 2) for k in a if k in b}
            out[name][f"loop / plain loop at {few} intervals"] = (
                round(a["loop_s"] / got[("plain", few)]["loop_s"], 3)
                if got.get(("plain", few))
                else None
            )
    return out


def main() -> None:
    sys.path.insert(0, HERE)
    import side_runner  # run.py's sides, run as child processes, and their standing server

    parser = side_runner.sides_parser(__doc__.splitlines()[0], rounds=3)
    parser.add_argument(
        "--reruns",
        type=int,
        default=8,
        help="reruns of each system for the rerun's floor (0: none)",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "FLOOR.json"))
    args = parser.parse_args()
    few, many = side_runner.interval_counts(parser, args.intervals)
    if args.rounds < 0 or args.reruns < 0:
        parser.error(f"--rounds {args.rounds}, --reruns {args.reruns}: give 0 (none) or more")
    side_args = argparse.Namespace(steps=args.steps, every=None, dispatch=10)
    report: dict = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "steps": args.steps,
        "intervals": [few, many],
        "rounds": [],
    }
    with side_runner.sides_server("floor-") as (server, env, machine):
        report["machine"] = machine
        for r in range(args.rounds):
            got: dict = {}
            order = SIDES if r % 2 == 0 else SIDES[::-1]  # alternated: a slow minute hits each side
            for n in (few, many):
                for name in order:
                    before = server.cpu_s()
                    res = side_runner.side(
                        name,
                        side_args,
                        env,
                        every=max(1, args.steps // n),
                        label=f"{name} x{n}, round {r + 1}/{args.rounds}",
                    )
                    server.settle(limit_s=10.0)
                    if res is not None:
                        got[(name, n)] = {
                            "loop_s": res["loop_s"],
                            "cpu_s": res["cpu_s"],
                            "server_cpu_s": server.cpu_s() - before,
                        }
            report["rounds"].append(
                {
                    "raw": {f"{name} x{n}": v for (name, n), v in got.items()},
                    "per_interval_ms": per_interval(got, few, many),
                }
            )
            done = [p["per_interval_ms"] for p in report["rounds"]]
            report["per_interval_ms"] = {
                name: {
                    k: statistics.median(values)
                    for k in set().union(*(d.get(name, {}) for d in done))
                    if (values := [d[name][k] for d in done if d.get(name, {}).get(k) is not None])
                }
                for name in SIDES
                if any(name in d for d in done)
            }
            with open(
                args.out, "w"
            ) as f:  # after every round: a cut-off run keeps what it measured
                json.dump(report, f, indent=1)
        if args.reruns > 0:
            report["rerun"] = rerun_floor(env, args.reruns)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    print(json.dumps({k: report.get(k) for k in ("per_interval_ms", "rerun")}), flush=True)


if __name__ == "__main__":
    main()
