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
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def log(msg: str) -> None:
    print(f"[goodput] {msg}", file=sys.stderr, flush=True)


# -- the harness --------------------------------------------------------------------------------


def prefect_jax_command(args, workdir: str, program: list[str]) -> list[str]:
    """The ``prefect-jax run`` command of the job for each system's comparison: `program`'s flags
    (``--program`` and any ``--program-param``), checkpoints every --every steps, no exporters."""
    cli = os.path.join(os.path.dirname(sys.executable), "prefect-jax")
    return [
        cli,
        "run",
        *program,
        "--job",
        "gp",
        "--storage",
        os.path.join(workdir, "storage"),
        "--max-steps",
        str(args.steps),
        "--checkpoint-every-steps",
        str(args.every),
        "--exporters",
        "--mlflow-tracking-uri",
        f"sqlite:///{workdir}/mlflow.db",
        "--compilation-cache",
        "job",
        "--no-progress",
        "--json",
    ] + args.prefect_jax_args.split()


def command(system: str, args, workdir: str, server_env: dict) -> tuple[list[str], dict]:
    lm = getattr(args, "model", "digits") == "lm"  # (floor.py's namespace has no model)
    if system == "prefect_jax" and lm:
        import goodput_lm

        return goodput_lm.prefect_jax_command(args, workdir), dict(server_env)
    if system == "prefect_jax":
        cmd = prefect_jax_command(args, workdir, ["--program", "bench_programs:wide"])
        env = dict(server_env, PYTHONPATH=HERE + os.pathsep + server_env.get("PYTHONPATH", ""))
        return cmd, env
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        system,
        "--workdir",
        workdir,
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
    ]
    if lm:
        cmd += ["--model", "lm", "--lm-params", args.lm_params]
    return cmd, dict(server_env)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), whatever their sessions: `prefect-jax run
    --processes N` starts its N processes in sessions of their own."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_all(pid: int) -> None:
    """SIGKILL `pid`'s process group and every process below it, in one sweep: a lost machine
    gives no process a chance to act (a launcher's children would otherwise get its death signal,
    SIGTERM, and checkpoint)."""
    procs: list[int] = []
    new = [pid, *_descendants(pid)]  # listed while they live: the dead's children move to init
    while new:  # frozen first, none of them sees another's death; again for any forked meanwhile
        for p in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGSTOP)
        procs += new
        new = [p for p in _descendants(pid) if p not in procs]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def run_job(system: str, args, period: float | None, sig: str | None, server_env: dict) -> dict:
    """Run the job to the end, killing each process `period` s after it starts; the totals."""
    workdir = tempfile.mkdtemp(prefix=f"goodput-{system}-")
    cmd, env = command(system, args, workdir, server_env)
    attempts, t_all = [], time.time()
    while True:
        t0 = time.time()
        with open(os.path.join(workdir, f"attempt-{len(attempts)}.log"), "w") as out:
            proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            killed = False
            try:
                proc.wait(timeout=period)
            except subprocess.TimeoutExpired:
                killed = True
                if sig == "KILL":  # the machine is lost: every process of the job dies at once
                    _kill_all(proc.pid)
                else:  # to the main process, as Kubernetes or a spot VM's shutdown does
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        attempts.append({"wall_s": time.time() - t0, "exit": proc.returncode, "killed": killed})
        if proc.returncode == 0:
            break
        if not killed or len(attempts) >= args.max_attempts:
            with open(os.path.join(workdir, f"attempt-{len(attempts) - 1}.log")) as f:
                tail = f.read()[-3000:]
            if period is None:  # an uninterrupted job that fails: the harness is broken
                raise RuntimeError(
                    f"{system}: attempt {len(attempts)} exited {proc.returncode} "
                    f"(killed={killed}):\n{tail}"
                )
            # A job that cannot resume (say, a backup file torn by the signal) is a result: it never
            # finishes without someone's help. Recorded, and the other runs go on.
            error = next(
                (line for line in reversed(tail.splitlines()) if line.strip()),
                f"exit {proc.returncode}",
            )
            log(f"{system} T={period} {sig}: attempt {len(attempts)} could not resume: {error}")
            return {
                "system": system,
                "period_s": period,
                "signal": sig,
                "total_s": time.time() - t_all,
                "attempts": len(attempts),
                "exits": [a["exit"] for a in attempts],
                "failed": error[:300],
                "breakdown": {},
            }
    result = {
        "system": system,
        "period_s": period,
        "signal": sig,
        "total_s": time.time() - t_all,
        "attempts": len(attempts),
        "exits": [a["exit"] for a in attempts],
        "attempt_wall_s": [round(a["wall_s"], 2) for a in attempts],
    }
    result["breakdown"] = breakdown(system, workdir)
    if getattr(args, "model", "digits") == "lm":  # the step each system ended at (checked in main)
        result["final_step"] = final_step(system, workdir, len(attempts) - 1)
        if system == "keras":
            with open(os.path.join(workdir, "keras_params.json")) as f:
                result["param_counts"] = json.load(f)
    if os.environ.get("GOODPUT_KEEP") != "1":
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    else:
        result["workdir"] = workdir
    log(
        f"{system} T={period} {sig}: {result['total_s']:.1f}s in {result['attempts']} attempt(s) "
        f"{result['exits']}"
    )
    return result


def final_step(system: str, workdir: str, last: int) -> int | None:
    """The step the finished attempt reports: the command's JSON summary, or a peer's done mark."""
    if system == "prefect_jax":
        with open(os.path.join(workdir, f"attempt-{last}.log")) as f:
            for line in reversed(f.read().splitlines()):
                if line.startswith("{"):
                    return json.loads(line).get("final_step")
        return None
    with open(os.path.join(workdir, "attempts.jsonl")) as f:
        done = [json.loads(line) for line in f if '"done"' in line]
    return done[-1]["step"] if done else None


def breakdown(system: str, workdir: str) -> dict:
    """Where each system's time went: the job's ledger (prefect_jax), or the peers' marks."""
    if system == "prefect_jax":
        with open(os.path.join(workdir, "storage", "gp", "goodput.json")) as f:
            ledger = json.load(f)
        sys.path.insert(0, os.path.dirname(HERE))
        from prefect_jax.training.goodput_summary import summarize

        summary = summarize(ledger)
        restarts = [
            sum(a["seconds"].get(k, 0.0) for k in ("startup", "restore", "compile"))
            for a in ledger["attempts"][1:]
        ]
        return {
            "source": "ledger",
            "goodput_ledger": round(summary["goodput"], 4),
            "lost_s": summary["lost_s"],
            "productive_s": round(summary["productive_s"], 2),
            "restart_s": [round(r, 3) for r in restarts],
            # (a step off the --every grid: resumed from a backup)
            "restored_steps": [a.get("from_step") for a in ledger["attempts"]],
        }
    marks: dict[int, dict] = {}
    with open(os.path.join(workdir, "attempts.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            marks.setdefault(m["pid"], {})[m["event"]] = m
    out = {"startup": 0.0, "restore": 0.0, "compile": 0.0}
    for m in marks.values():
        start = m["start"]["process_start"]
        if "imported" in m:
            out["startup"] += m["imported"]["t"] - start
        if "restored" in m and "imported" in m:
            out["restore"] += m["restored"]["t"] - m["imported"]["t"]
        if "first_step" in m and "restored" in m:
            out["compile"] += m["first_step"]["t"] - m["restored"]["t"] - _evaluated_again(m)
    restored = [m["restored"]["step"] for m in marks.values() if "restored" in m]
    # A rerun's way back: from its process start to its first new step done (imports included),
    # less an evaluation a kill interrupted, done again before it (the ledger counts that as eval).
    restarts = [
        m["first_step"]["t"] - m["start"]["process_start"] - _evaluated_again(m)
        for m in marks.values()
        if "first_step" in m and m.get("restored", {}).get("step", 0) > 0
    ]
    return {
        "source": "marks",
        "lost_s": {k: round(v, 2) for k, v in out.items()},
        "restored_steps": restored,
        "restart_s": [round(r, 3) for r in restarts],
        "evaluated_again": [
            m["evaluated_again"]["step"] for m in marks.values() if "evaluated_again" in m
        ],
    }


def _evaluated_again(marks: dict) -> float:
    """Seconds a peer's attempt spent evaluating its restored step again (its evaluation was
    interrupted), between its restore and its first step."""
    return marks.get("evaluated_again", {}).get("secs", 0.0)


def warm_up(env: dict) -> None:
    """One small flow run first, not measured: a standing server has seen flows before (its first
    flow run registers the flow and warms its database; the client writes its profile)."""
    with tempfile.TemporaryDirectory(prefix="goodput-warmup-") as d:
        cli = os.path.join(os.path.dirname(sys.executable), "prefect-jax")
        cli = (
            [cli] if os.path.exists(cli) else [sys.executable, "-m", "prefect_jax.cli"]
        )  # packages on PYTHONPATH (gpu_check.sh)
        subprocess.run(
            [
                *cli,
                "run",
                "--program",
                "prefect_jax.examples.digits:tiny",
                "--job",
                "warm",
                "--storage",
                d,
                "--max-steps",
                "20",
                "--checkpoint-every-steps",
                "10",
                "--exporters",
                "--mlflow-tracking-uri",
                f"sqlite:///{d}/mlflow.db",
                "--no-progress",
            ],
            env=env,
            capture_output=True,
            check=True,
        )


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
