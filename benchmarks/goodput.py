r"""Goodput under preemption: a job killed every T seconds and rerun at once, per system.

Each system trains the same job (`bench_programs:wide`: a 64-1024-1024-10 MLP on digits, batch
256, --steps steps, a checkpoint and a full evaluation every --every steps, JAX's persistent
compilation cache on) in a fresh process. The harness sends SIGTERM (or SIGKILL) T seconds after
each process starts and starts the next one as soon as it exits, as a rerun automation does,
until a process exits 0 at --steps. Then:

    goodput = (wall time of the same system's uninterrupted run) / (total wall time, every attempt)

and ``vs plain``: the plain loop's uninterrupted wall / this total, so that a system with a
slow uninterrupted run is not flattered. Systems:

- ``prefect_jax``: the ``prefect-jax run`` command (the `train_and_evaluate` flow) against a
  standing ``prefect server``, SQLite MLflow, no exporters; ``--compilation-cache job``. On
  SIGTERM it commits the step in flight and exits 143. The lost time's breakdown is the job's
  own goodput ledger (``<job>/goodput.json``, see `prefect_jax.training.goodput`), which the
  flow also logs to MLflow (``goodput/*``) and to a Prefect table artifact.
- ``plain``: a hand-written JAX + optax + Orbax loop, step-indexed data (batch i is a pure
  function of i, so a resume is exact), async checkpoints; no SIGTERM handler, as such loops
  are usually written: a SIGTERM kills it like a SIGKILL.
- ``keras``: Keras 3 ``fit`` on JAX with ``BackupAndRestore`` (one epoch = --every steps).
- ``plain_prefect`` and ``plain_flow`` (`floor.py`'s rerun floor; not in the default
  ``--systems``): the plain loop importing Prefect first (the collector off for that import), and
  the plain loop as a Prefect flow run of task runs (see `goodput_peers.child_plain`).

The job must outlast the periods, or nothing is signalled and a row compares uninterrupted runs:
where a system's uninterrupted run lasts less than --min-periods (1.5) of the longest period, the
harness raises --steps in proportion (a multiple of --every) and runs the uninterrupted jobs
again; the result says so (``sized``).

For the peers, each process writes when it started, finished importing, restored (and at which
step) and ran its first step; the harness sums start-up, restore and compile from those.

    uv run --group bench python benchmarks/goodput.py  # T = 15, 30, 60; SIGTERM, SIGKILL
    uv run --group bench python benchmarks/goodput.py --periods 20 --signals TERM \
        --systems prefect_jax,plain --steps 2000
    uv run --group bench python benchmarks/goodput.py --periods 15 --signals KILL \
        --prefect-jax-args '--checkpoint-every-secs 5'
    uv run --group bench python benchmarks/goodput.py --model lm --periods 30,60 \
        --out benchmarks/GOODPUT-LM.json  # the byte LM (`goodput_lm.py`): same three systems

--repeats N runs everything N times in rounds, and --add-to FILE adds rounds to an earlier result;
goodputs then divide by the mean uninterrupted wall (single runs on a shared VM differ by seconds).

With --model lm the job is the byte LM (see `goodput_lm.py`), and the harness exits non-zero
(after its JSON) where a system never finishes or ends at another step than --steps.

Progress goes to stderr; the last stdout line is one JSON object (also --out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = False  # (before the imports below: their .pyc files are written too)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from goodput_jobs import log, run_job, warm_up  # noqa: E402


def sized_steps(steps: int, every: int, uninterrupted: dict[str, dict], min_wall_s: float) -> int:
    """`steps`, or more (a multiple of `every`) where the shortest uninterrupted run lasted under
    `min_wall_s`: scaled by the wall it lacked (with 10% to spare: start-up does not scale)."""
    walls = [u["total_s"] for u in uninterrupted.values() if "failed" not in u]
    if not walls or min(walls) >= min_wall_s:
        return steps
    return math.ceil(steps * min_wall_s * 1.1 / min(walls) / every) * every


def _score(runs: list[dict], rounds: list[dict[str, dict]]) -> None:
    """Each run's goodput (its system's mean uninterrupted wall / its total; 0 for a job that
    never finished by itself) and ``vs_plain`` (the plain loop's mean uninterrupted wall / its
    total)."""
    from report_goodput import mean_uninterrupted

    reference = mean_uninterrupted(rounds)
    for r in runs:
        failed = "failed" in r  # no goodput: the job never finishes by itself
        r["goodput"] = 0.0 if failed else reference[r["system"]] / r["total_s"]
        if "plain" in reference:
            r["vs_plain"] = 0.0 if failed else reference["plain"] / r["total_s"]


def _earlier_rounds(path: str, args, systems, periods, signals) -> dict:
    """The earlier result at `path` (--add-to), refused unless its job and cells are these."""
    with open(path) as f:
        earlier = json.load(f)
    earlier.setdefault("uninterrupted_repeats", [earlier["uninterrupted"]])
    for run in earlier["runs"]:
        run.setdefault("repeat", 0)
    mine = {
        "steps": args.steps,
        "every": args.every,
        "systems": sorted(systems),
        "cells": sorted((p, s) for p in periods for s in signals),
        "prefect_jax_args": args.prefect_jax_args,
    }
    theirs = {
        "steps": earlier["steps"],
        "every": earlier["every"],
        "systems": sorted(earlier["uninterrupted"]),
        "cells": sorted({(r["period_s"], r["signal"]) for r in earlier["runs"]}),
        "prefect_jax_args": earlier.get("prefect_jax_args", ""),
    }
    if getattr(args, "model", "digits") == "lm":
        import goodput_lm

        mine["lm_params"], theirs["lm_params"] = goodput_lm.lm_params(args), earlier["lm"]["params"]
    differ = {k: (theirs[k], mine[k]) for k in mine if mine[k] != theirs[k]}
    if differ:
        sys.exit(
            f"[goodput] --add-to {path}: measured with other settings ({differ}: theirs, these): "
            "give the same --steps, --every, --systems, --periods, --signals and program params"
        )
    return earlier


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="prefect_jax,plain,keras")
    parser.add_argument(
        "--periods", default="15,30,60", help="seconds between preemptions (comma-separated)"
    )
    parser.add_argument("--signals", default="TERM,KILL")
    parser.add_argument(
        "--model",
        choices=["digits", "lm"],
        default="digits",
        help="digits: bench_programs:wide (the default); lm: the byte LM (goodput_lm.py)",
    )
    parser.add_argument(
        "--lm-params",
        default="{}",
        metavar="JSON",
        help="--model lm: overrides of goodput_lm.LM_PARAMS, the byte LM's program params",
    )
    parser.add_argument("--steps", type=int, default=None, help="default: 8000 (lm: 120)")
    parser.add_argument(
        "--min-periods",
        type=float,
        default=1.5,
        metavar="N",
        help="more steps (then the uninterrupted runs again) where a system's uninterrupted run "
        "lasts less than N of the longest period, so that every period interrupts every system "
        "(0: never)",
    )
    parser.add_argument("--every", type=int, default=None, help="default: 500 (lm: 10)")
    parser.add_argument("--max-attempts", type=int, default=40)
    parser.add_argument(
        "--prefect-jax-args",
        default="",
        metavar="ARGS",
        help="more arguments for the prefect-jax command, e.g. '--checkpoint-every-secs 5' "
        "(the peers keep --every)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every run (the uninterrupted ones too), one after another: the verdicts "
        "use each system's mean total per cell, as single runs on a shared VM vary by seconds",
    )
    parser.add_argument(
        "--add-to",
        default=None,
        metavar="FILE",
        help="a result of this harness with the same job, systems, periods and signals: its "
        "rounds come first, this invocation's are added after them (written to --out)",
    )
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    parser.add_argument(
        "--child", choices=["plain", "plain_prefect", "plain_flow", "keras"], help=argparse.SUPPRESS
    )
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    lm = args.model == "lm"
    args.steps = args.steps or (120 if lm else 8000)
    args.every = args.every or (10 if lm else 500)
    if args.child:  # a peer's attempt (`command`): the harness checked its flags
        return args
    if lm and set(args.systems.split(",")) - {"prefect_jax", "plain", "keras"}:
        parser.error(f"--systems {args.systems!r}: --model lm has prefect_jax, plain and keras")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more rounds")
    if args.add_to and args.min_periods:
        parser.error("--add-to: give --min-periods 0 and the earlier result's --steps")
    if args.steps % args.every:
        parser.error(
            f"--steps ({args.steps}) must be a multiple of --every ({args.every}): "
            "one Keras epoch is --every steps"
        )
    return args


def measure(args) -> dict:
    """Every system's uninterrupted runs, then its run per period and signal, in --repeats
    rounds against one standing Prefect server; the result (with earlier rounds of --add-to),
    scored."""
    from standing_server import StandingServer

    lm = args.model == "lm"
    systems = args.systems.split(",")
    periods = [float(p) for p in args.periods.split(",") if p]
    signals = [s for s in args.signals.split(",") if s]
    work = tempfile.mkdtemp(prefix="goodput-")
    base = dict(
        os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING"
    )
    base.pop("PREFECT_API_URL", None)
    report: dict = {
        "steps": args.steps,
        "every": args.every,
        "program": "bench_programs:wide",
        "runs": [],
        "prefect_jax_args": args.prefect_jax_args,
    }
    earlier = _earlier_rounds(args.add_to, args, systems, periods, signals) if args.add_to else None
    t = time.time()
    if lm:  # the corpus is built before any clock, once for all systems
        import goodput_lm

        report.update(program=goodput_lm.PROGRAM, lm=goodput_lm.build_corpus(args))
        log(f"byte LM: {report['lm']}")
    with StandingServer(os.path.join(work, "server-home")) as server:
        env = dict(base, PREFECT_API_URL=server.url, PREFECT_HOME=os.path.join(work, "client-home"))
        warm_up(env)
        first = len(earlier["uninterrupted_repeats"]) if earlier else 0

        def uninterrupted_runs(k: int) -> dict[str, dict]:
            # (each round's references, in the same turned order as its first cell)
            return {s: run_job(s, args, None, None, env) for s in _turn(systems, k)}

        uninterrupted = uninterrupted_runs(first)
        min_wall_s = args.min_periods * max(periods, default=0)
        # Quick cores: a job shorter than a period is never interrupted, and measures nothing.
        # Sizing in proportion scales the start-up too, so a job with a long one can still fall
        # short: sized again, a few times at most.
        for _ in range(3):
            steps = sized_steps(args.steps, args.every, uninterrupted, min_wall_s)
            if steps == args.steps:
                break
            report.setdefault(
                "sized",
                {
                    "steps_before": args.steps,
                    "uninterrupted_before": uninterrupted,
                    "min_wall_s": min_wall_s,
                },
            )
            log(
                "the shortest uninterrupted run took "
                f"{min(u['total_s'] for u in uninterrupted.values()):.1f} s, under "
                f"{args.min_periods:g} x {max(periods):g} s: {steps} steps instead of {args.steps}"
            )
            args.steps = report["steps"] = steps
            uninterrupted = uninterrupted_runs(first)
        rounds = [uninterrupted]
        cells = [(period, sig) for period in periods for sig in signals]
        for repeat in range(args.repeats):
            if repeat:  # a round's own references, in the same conditions as its cells
                rounds.append(uninterrupted_runs(first + repeat))
            for cell, (period, sig) in enumerate(cells):
                ran = []
                for position, s in enumerate(_turn(systems, first + repeat + cell)):
                    r = run_job(s, args, period, sig, env)
                    r["repeat"], r["ran"] = first + repeat, position
                    ran.append(r)
                # kept in the systems' own order, as the report lists them ("ran": which went first)
                report["runs"] += sorted(ran, key=lambda r: systems.index(r["system"]))
    if earlier:
        report["runs"] = earlier["runs"] + report["runs"]
        rounds = earlier["uninterrupted_repeats"] + rounds
    report["uninterrupted"], report["uninterrupted_repeats"] = rounds[0], rounds
    _score(report["runs"], rounds)
    report["total_s"] = time.time() - t
    return report


def _turn(systems: list[str], k: int) -> list[str]:
    """`systems` rotated by `k`: each cell (and each round's uninterrupted runs) starts with the
    next system, so that none always runs first after the VM's idle or last before its drift."""
    k %= len(systems)
    return systems[k:] + systems[:k]


def unfinished(report: dict, steps: int) -> list[str]:
    """Each run (uninterrupted ones too) that never finished or ended at another step than
    `steps`, said in a few words."""
    return [
        f"{r['system']} T={r['period_s']} {r['signal']}: "
        + (f"never finished ({r['failed']})" if "failed" in r else f"final step {r['final_step']}")
        for r in [
            *(u for rnd in report["uninterrupted_repeats"] for u in rnd.values()),
            *report["runs"],
        ]
        if "failed" in r or r.get("final_step") != steps
    ]


def main() -> None:
    args = parse_args()
    sys.path.insert(0, HERE)
    if args.child:
        if args.model == "lm":
            import goodput_lm as peers
        else:
            import goodput_peers as peers
        (peers.child_keras if args.child == "keras" else peers.child_plain)(args)
        return
    report = measure(args)
    line = json.dumps(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    bad = unfinished(report, args.steps) if args.model == "lm" else []
    if bad:  # a system that never finished, or finished elsewhere, is no goodput: say so loudly
        sys.exit(f"[goodput] expected every system to end at step {args.steps}: " + "; ".join(bad))


if __name__ == "__main__":
    main()
