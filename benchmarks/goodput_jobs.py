"""One job of the goodput harness (`goodput.py`), run to its end: each system's command, an attempt
killed `period` s after it starts (SIGTERM to the main process, or every process of the job at
once for SIGKILL, as a lost machine), the next attempt started as soon as it exits, and where
the time went: the prefect-jax job's own goodput ledger, or the peers' marks
(`goodput_peers.mark`). Also used by `floor.py` (the rerun's floor) and, for its warm-up flow
run, by `run.py` and `server_apart.py`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS = os.path.join(HERE, "goodput.py")  # a peer's attempt is `goodput.py --child NAME`


def log(msg: str) -> None:
    print(f"[goodput] {msg}", file=sys.stderr, flush=True)


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
        HARNESS,
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


def _attempt(cmd: list[str], env: dict, log_path: str, period: float | None, sig: str | None):
    """One process of the job, signalled `period` s after it starts; (wall s, exit, killed)."""
    t0 = time.time()
    with open(log_path, "w") as out:
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
    return {"wall_s": time.time() - t0, "exit": proc.returncode, "killed": killed}


def run_job(system: str, args, period: float | None, sig: str | None, server_env: dict) -> dict:
    """Run the job to the end, killing each process `period` s after it starts; the totals."""
    workdir = tempfile.mkdtemp(prefix=f"goodput-{system}-")
    cmd, env = command(system, args, workdir, server_env)
    attempts, t_all = [], time.time()

    def totals() -> dict:
        return {
            "system": system,
            "period_s": period,
            "signal": sig,
            "total_s": time.time() - t_all,
            "attempts": len(attempts),
            "exits": [a["exit"] for a in attempts],
        }

    while True:
        log_path = os.path.join(workdir, f"attempt-{len(attempts)}.log")
        attempts.append(_attempt(cmd, env, log_path, period, sig))
        last = attempts[-1]
        if last["exit"] == 0:
            break
        if not last["killed"] or len(attempts) >= args.max_attempts:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            if period is None:  # an uninterrupted job that fails: the harness is broken
                raise RuntimeError(
                    f"{system}: attempt {len(attempts)} exited {last['exit']} "
                    f"(killed={last['killed']}):\n{tail}"
                )
            # A job that cannot resume (say, a backup file torn by the signal) is a result: it never
            # finishes without someone's help. Recorded, and the other runs go on.
            error = next(
                (line for line in reversed(tail.splitlines()) if line.strip()),
                f"exit {last['exit']}",
            )
            log(f"{system} T={period} {sig}: attempt {len(attempts)} could not resume: {error}")
            return {**totals(), "failed": error[:300], "breakdown": {}}
    result = {**totals(), "attempt_wall_s": [round(a["wall_s"], 2) for a in attempts]}
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
