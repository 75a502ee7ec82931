"""The fault-injection sweep: kill the real CLI at named moments, rerun it at once (as the rerun
automation would), and compare what is left with an uninterrupted run of the same job.

    uv run python benchmarks/faults.py                      # every kill point, SIGKILL and SIGTERM
    uv run python benchmarks/faults.py --points save_tmp eval --signals KILL

Everything is real: a standing ``prefect server``, ``prefect-jax run`` processes (each in its
own process group, signalled as a whole, as a spot VM's shutdown does), Orbax checkpoints on
disk, a moto S3 server on loopback for the upload point, one MLflow SQLite store. The job is
``tests/programs.py:big`` (24 MiB of state, so a save lasts long enough to land a signal in each
of its phases), 400 steps, a checkpoint, an evaluation and the three exporters every 100 steps.

For each kill point × signal it checks, against the uninterrupted run:

- fingerprint: the final ``state_fingerprint`` is the uninterrupted one, steps 100, 200, 300,
  400 are committed (a SIGTERM mid-interval also commits its step: a preemption checkpoint,
  resumed from, never evaluated) and exactly those are evaluated;
- exports: the same exporters with the same steps, the same best step and value, and the same
  registered model versions and aliases;
- MLflow: one run, FINISHED; ``eval/*`` at each evaluated step exactly once; the train
  metrics at every log step exactly once;
- Prefect: the rerun's flow run Completed, every earlier one of the job Crashed or Failed,
  no task run of the job left Running or Pending;
- notice: a SIGTERM that landed ended its run (the command exits 143), not trained on to the
  end (exit 0, the one exit this check fails): a notice the job did not heed costs a spot node
  every step since its last checkpoint.

It writes the table to ``FAULTS.md`` (and prints it); the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))

from deployment_helpers import PrefectServerProcess  # noqa: E402
from faults_job import (  # noqa: E402
    CHECKS,
    EVERY,
    best_record,
    command,
    environment,
    job_status,
    last_json,
    outcome,
)
from s3_server import S3Server  # noqa: E402

from prefect_jax.training.names import COMMIT_MARKER  # noqa: E402

# The moments are those of the interval 100 to 200 and of step 200's save, eval and export.
KILL_STEP = 200

POINTS = {
    "flow_start": "Prefect began the flow run (before the restore)",
    "compile": "the first interval started: the train step compiling",
    "mid_interval": "half-way through the interval 100 to 200",
    "save_tmp": "step 200's Orbax temporary directory created",
    "save_partial": "step 200's temporary directory partly written (>= 1 MiB of 24)",
    "save_renamed": "step 200 renamed into place (committed, not yet evaluated)",
    "eval": "the train task of step 200 finished: its evaluation running",
    "export": "the evaluation of step 200 finished: its exports running",
    "s3_upload": "s3:// storage: step 200 partly uploaded, no commit marker yet",
}
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}


def _dir_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass
    return total


def _moment(point: str, log: Path, ckpt: Path, s3_prefix: str | None, s3fs) -> bool:
    """Whether the run has reached `point` (read from its log and its files)."""
    text = log.read_text(errors="replace")
    if point == "flow_start":
        return "Beginning flow run" in text
    if point == "compile":
        return "training from step 0 to" in text
    if point == "mid_interval":
        return f"training from step {KILL_STEP - EVERY} to {KILL_STEP}" in text
    if point == "eval":
        return f"'train {KILL_STEP - EVERY} to {KILL_STEP}' - Finished" in text
    if point == "export":
        return f"'evaluate {KILL_STEP}' - Finished" in text
    if point == "s3_upload":
        try:
            files = s3fs.find(f"{s3_prefix}/{KILL_STEP}", refresh=True)
        except FileNotFoundError:
            return False
        return bool(files) and not any(f.endswith(f"/{COMMIT_MARKER}") for f in files)
    tmp = [p for p in ckpt.glob(f"{KILL_STEP}.orbax-checkpoint-tmp*")] if ckpt.exists() else []
    if point == "save_tmp":
        return bool(tmp)
    if point == "save_partial":
        return any(_dir_bytes(p) >= 1 << 20 for p in tmp)
    if point == "save_renamed":
        return (ckpt / str(KILL_STEP)).is_dir()  # Orbax's rename is the commit
    raise ValueError(point)


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    out = open(log, "w")
    return subprocess.Popen(
        args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=TESTS, start_new_session=True
    )


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    """`proc`'s exit code; its process group SIGKILLed past `timeout` seconds."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def run_point(point: str, sig: str, ctx: dict, round_: int = 1) -> dict:
    job = f"{point.replace('_', '-')}-{sig.lower()}" + (f"-{round_}" if round_ > 1 else "")
    remote = point == "s3_upload"
    storage = "s3://faults/sweep" if remote else str(ctx["work"] / "storage")
    env = environment(ctx["api_url"], ctx["s3"] if remote else None, ctx["work"] / "cache" / job)
    logs = ctx["work"] / "logs"
    ckpt = ctx["work"] / "storage" / job / "checkpoints"
    s3fs = ctx["s3"].filesystem() if remote else None
    s3_prefix = f"faults/sweep/{job}/checkpoints" if remote else None

    first = logs / f"{job}-1.log"
    proc = _start(command(job, storage, ctx["mlflow_uri"]), env, first)
    hit, deadline = False, time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if _moment(point, first, ckpt, s3_prefix, s3fs):
            hit = True
            os.killpg(proc.pid, SIGNALS[sig])
            break
        time.sleep(0.002)
    try:
        rc1 = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc1 = proc.wait()
    attempts, summary = 1, None
    if rc1 == 0:
        summary = last_json(first)
    while summary is None and attempts < 4:  # the rerun automation: run again at once
        attempts += 1
        log = logs / f"{job}-{attempts}.log"
        rerun = _start(command(job, storage, ctx["mlflow_uri"]), env, log)
        rc = rerun.wait(timeout=600)
        if rc == 0:
            summary = last_json(log)
    if summary is not None:
        summary["best"] = best_record(job, ctx, remote)
    row = outcome(
        job,
        storage,
        summary,
        ctx["reference_s3" if remote else "reference"],
        ctx["mlflow_uri"],
        ctx["api_url"],
        env,
    )
    heeded = not (hit and sig == "TERM" and rc1 == 0)
    row["notice"] = (
        heeded,
        "" if heeded else "the SIGTERM landed and the run trained on to its end (exit 0)",
    )
    return {
        "point": point,
        "signal": sig,
        "job": job,
        "hit": hit,
        "first_rc": rc1,
        "attempts": attempts,
        **{k: {"ok": ok, "detail": detail} for k, (ok, detail) in row.items()},
    }


def reference_run(ctx: dict, remote: bool) -> dict:
    job = "straight-s3" if remote else "straight"
    storage = "s3://faults/sweep" if remote else str(ctx["work"] / "storage")
    env = environment(ctx["api_url"], ctx["s3"] if remote else None, ctx["work"] / "cache" / job)
    log = ctx["work"] / "logs" / f"{job}.log"
    proc = _start(command(job, storage, ctx["mlflow_uri"]), env, log)
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{log.read_text()[-4000:]}")
    summary = last_json(log)
    status = job_status(job, storage, env)
    best = best_record(job, ctx, remote)
    registry = {k: status.get("registered_model", {}).get(k) for k in ("versions", "aliases")}
    return {
        "state_fingerprint": summary["state_fingerprint"],
        "mlflow_run_id": summary["mlflow_run_id"],
        "exports": status["exports"],
        "best": best,
        "registry": registry,
    }


def markdown(results: list[dict], seconds: float) -> str:
    cols = CHECKS
    lines = [
        "# Fault-injection sweep",
        "",
        "Written by `uv run python benchmarks/faults.py` "
        "(see its docstring for what each column checks).",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}; "
        f"{seconds / 60:.1f} min.",
        "The job: `tests/programs.py:big` (24 MiB state), 400 steps, "
        "checkpoint + eval + exporters every 100;",
        "each run killed once at the moment named (its whole process group), "
        "then rerun at once until it exits 0;",
        "cells count the scenarios that passed "
        "(several rounds: the moments land a little differently each time).",
        "",
        "| kill point | signal | landed | first exit | runs to finish | fingerprint "
        "| exports + registry | MLflow | Prefect states | notice heeded |",
        "|---|---|---|---:|---:|---|---|---|---|---|",
    ]
    for point in POINTS:
        for sig in SIGNALS:
            rs = [r for r in results if r["point"] == point and r["signal"] == sig]
            if not rs:
                continue
            cells = []
            for c in cols:
                failed = [r[c]["detail"] for r in rs if not r[c]["ok"]]
                cells.append(
                    f"{len(rs) - len(failed)}/{len(rs)}" + (f" FAIL: {failed[0]}" if failed else "")
                )
            landed = sum(r["hit"] for r in rs)
            exits = ", ".join(sorted({str(r["first_rc"]) for r in rs}))
            runs = ", ".join(sorted({str(r["attempts"]) for r in rs}))
            lines.append(
                f"| {point}: {POINTS[point]} | SIG{sig} | {landed}/{len(rs)} | {exits} | {runs} | "
                + " | ".join(cells)
                + " |"
            )
    counts = {c: sum(r[c]["ok"] for r in results) for c in cols}
    lines.append(
        "| **passed** | | | | | "
        + " | ".join(f"**{counts[c]}/{len(results)}**" for c in cols)
        + " |"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--points", nargs="*", choices=list(POINTS), default=list(POINTS))
    parser.add_argument("--signals", nargs="*", choices=list(SIGNALS), default=list(SIGNALS))
    parser.add_argument(
        "--out", default=str(ROOT / "FAULTS.md"), help="where the table goes (default FAULTS.md)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds over every point (the moments land differently each time)",
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="keep storage, logs and stores here (default: a temporary directory)",
    )
    args = parser.parse_args()

    sys.dont_write_bytecode = False  # this process and its commands load .pyc files, as run.py
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    started = time.monotonic()
    with (
        contextlib.nullcontext(args.workdir)
        if args.workdir
        else tempfile.TemporaryDirectory(prefix="prefect-jax-faults-")
    ) as tmp:
        work = Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        (work / "logs").mkdir(exist_ok=True)
        server = PrefectServerProcess(work / "prefect")
        s3 = S3Server() if "s3_upload" in args.points else None
        try:
            server.wait_healthy()
            if s3 is not None:
                s3.start()
                s3.create_bucket("faults")
            ctx = {
                "work": work,
                "api_url": server.api_url,
                "s3": s3,
                "mlflow_uri": f"sqlite:///{work}/mlflow.db",
            }
            ctx["reference"] = reference_run(ctx, remote=False)
            if s3 is not None:
                ctx["reference_s3"] = reference_run(ctx, remote=True)
            results = []
            for round_ in range(1, args.repeat + 1):
                for point in args.points:
                    for sig in args.signals:
                        result = run_point(point, sig, ctx, round_)
                        results.append(result)
                        print(json.dumps(result), flush=True)
        finally:
            server.stop()
            if s3 is not None:
                s3.stop()
    text = markdown(results, time.monotonic() - started)
    Path(args.out).write_text(text)
    print(text)
    passed = sum(all(r[c]["ok"] for c in CHECKS) for r in results)
    print(
        json.dumps(
            {
                "scenarios": len(results),
                "all_checks_passed": passed,
                "minutes": round((time.monotonic() - started) / 60, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
