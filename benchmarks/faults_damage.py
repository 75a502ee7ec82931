"""The fault sweep's damage families (issue 53): a full filesystem, damaged JSON records of each
kind, damaged checkpoint metadata, storage that vanishes and comes back.

    uv run python benchmarks/faults_damage.py                    # every family
    uv run python benchmarks/faults_damage.py --families full_disk vanished

The same job, server, stores and checks as `benchmarks/faults.py` (fingerprint, exports +
registry, MLflow, Prefect states against an uninterrupted run), plus one column of its own:

- truthful: the disturbed run said what happened. ``full_disk``: it exited non-zero without a
  summary, its flow run Failed with a train task run Failed by ``CheckpointSaveError`` (the
  filesystem refuses files past 12 MiB in that run: RLIMIT_FSIZE, so a write past it fails with
  EFBIG from the kernel; no root, mount or loop device needed). The record families: the rerun
  named the damaged file and ``status`` lists nothing damaged at the end (the damaged copy of the
  goodput ledger kept aside). ``metadata``: the step is moved aside as corrupt (never
  "The program changed"). ``vanished``: the run ended non-zero naming the job's directory as gone,
  and wrote nothing into the empty directory made in its place. ``mlflow_restart`` and
  ``mlflow_unreachable``: see `benchmarks/faults_mlflow.py`.

Each family disturbs one run (the record families: SIGKILL once step 200 is evaluated, then the
record damaged), then reruns the job at once until it exits 0. It appends its table to
``FAULTS.md`` (``--out``); the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import faults_job  # the job and its checks
from faults import KILL_STEP, ROOT, TESTS, _moment, _start, _wait, reference_run
from faults_job import CHECKS

sys.path.insert(0, str(TESTS))
from deployment_helpers import PrefectServerProcess  # noqa: E402
from faults_mlflow import FAMILIES as MLFLOW_FAMILIES  # noqa: E402
from faults_mlflow import RUNS as MLFLOW_RUNS  # noqa: E402

FAMILIES = {
    "full_disk": "every save refused by the filesystem (EFBIG past 12 MiB)",
    "eval_record": f"evals/eval/{KILL_STEP}.json truncated",
    "goodput_ledger": "goodput.json truncated",
    "registry": "registry.json truncated",
    "metadata": f"one bit flipped in step {KILL_STEP}'s metadata",
    "vanished": "the job's directory gone mid-interval, an empty one in its place; back after",
    **MLFLOW_FAMILIES,  # (benchmarks/faults_mlflow.py: its docstring says what they check)
}
LIMIT = 12 << 20
# The CLI in a process whose files may not grow past argv[1] bytes (its SIGXFSZ ignored: the
# write fails with EFBIG instead of the kernel killing the process).
LIMITED = (
    "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY)); "
    "sys.argv = ['prefect-jax'] + sys.argv[2:]; "
    "runpy.run_module('prefect_jax.cli', run_name='__main__')"
)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_meta_bit(step_dir: Path) -> None:
    meta = step_dir / "meta" / "metadata"
    data = bytearray(meta.read_bytes())
    data[data.index(b"float32") + len("float3")] ^= 0x01  # '2' -> '3'
    meta.write_bytes(bytes(data))


def _until(point: str, proc, log: Path, ckpt: Path, timeout: float = 300) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if _moment(point, log, ckpt, None, None):
            return True
        time.sleep(0.002)
    return False


def run_family(family: str, ctx: dict) -> dict:
    if family in MLFLOW_RUNS:
        return MLFLOW_RUNS[family](ctx)
    job = family.replace("_", "-")
    storage = str(ctx["work"] / "storage")
    job_dir = ctx["work"] / "storage" / job
    ckpt = job_dir / "checkpoints"
    env = faults_job.environment(ctx["api_url"], None, ctx["work"] / "cache" / job)
    logs = ctx["work"] / "logs"
    args = faults_job.command(job, storage, ctx["mlflow_uri"])
    first = logs / f"{job}-1.log"
    truthful, detail = True, []

    if family == "full_disk":
        proc = _start([sys.executable, "-c", LIMITED, str(LIMIT), *args[3:]], env, first)
        rc1 = _wait(proc, 600)
        text = first.read_text(errors="replace")
        said = "CheckpointSaveError" in text and "Finished in state Failed" in text
        truthful = rc1 != 0 and faults_job.last_json(first) is None and said
        detail.append(f"exit {rc1}, CheckpointSaveError named: {said}")
    elif family == "vanished":
        proc = _start(args, env, first)
        hit = _until("mid_interval", proc, first, ckpt)
        away = ctx["work"] / f"{job}-away"
        if hit:
            time.sleep(0.5)
            os.rename(job_dir, away)
            job_dir.mkdir()
        rc1 = _wait(proc, 600)
        text = first.read_text(errors="replace")
        phantom = sorted(os.listdir(job_dir)) if job_dir.exists() else []
        said = "JobDirectoryGoneError" in text
        truthful = hit and rc1 != 0 and said and not phantom
        detail.append(f"exit {rc1}, named: {said}, written into the new directory: {phantom}")
        if hit:
            shutil.rmtree(job_dir)
            os.rename(away, job_dir)
    else:
        target = {
            "eval_record": job_dir / "evals" / "eval" / f"{KILL_STEP}.json",
            "goodput_ledger": job_dir / "goodput.json",
            "registry": job_dir / "registry.json",
            "metadata": ckpt / str(KILL_STEP) / "meta" / "metadata",  # (once committed)
        }.get(family)
        proc = _start(args, env, first)
        hit = _until("export", proc, first, ckpt)
        # (the live step's eval record is written once its save commits: maybe a little later;
        # the step is renamed into place at its commit)
        deadline = time.monotonic() + 120
        while hit and target is not None and not target.exists() and time.monotonic() < deadline:
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGKILL)
        rc1 = _wait(proc, 120)
        if not hit or (target is not None and not target.exists()):
            truthful = False
            detail.append(
                f"moment missed (hit {hit}, {target} there: {target and target.exists()})"
            )
        elif family == "metadata":
            _flip_meta_bit(ckpt / str(KILL_STEP))
        else:
            _truncate(target)
        if family != "metadata" and hit:
            listed = [
                d["path"]
                for d in faults_job.job_status(job, storage, env).get("damaged_records", [])
            ]
            if not any(p.endswith(target.name) for p in listed):
                truthful = False
                detail.append(f"status did not name it: {listed}")

    attempts, summary = 1, None
    while summary is None and attempts < 4:  # the rerun automation: run again at once
        attempts += 1
        log = logs / f"{job}-{attempts}.log"
        if _wait(_start(args, env, log), 600) == 0:
            summary = faults_job.last_json(log)
            text = log.read_text(errors="replace")
            if family in ("eval_record", "goodput_ledger") and "is damaged" not in text:
                truthful = False
                detail.append("the rerun did not name the damaged record")
            if family == "metadata" and ("is corrupt" not in text or "program changed" in text):
                truthful = False
                detail.append("the damaged step was not moved aside as corrupt")
    if summary is not None:
        summary["best"] = faults_job.best_record(job, ctx, False)
        left = faults_job.job_status(job, storage, env).get("damaged_records", [])
        if left:
            truthful = False
            detail.append(f"still damaged: {left}")
    if family == "goodput_ledger" and not list(job_dir.glob("goodput.json.damaged-*")):
        truthful = False
        detail.append("the damaged ledger was not kept")
    row = faults_job.outcome(
        job, storage, summary, ctx["reference"], ctx["mlflow_uri"], ctx["api_url"], env
    )
    row["truthful"] = (truthful, "; ".join(detail))
    return {
        "family": family,
        "job": job,
        "first_rc": rc1,
        "attempts": attempts,
        **{k: {"ok": ok, "detail": d} for k, (ok, d) in row.items()},
    }


def markdown(results: list[dict], seconds: float, note: str = "") -> str:
    cols = (*CHECKS[:4], "truthful")
    lines = [
        "",
        "## Damage families",
        "",
        "Written by `uv run python benchmarks/faults_damage.py` (its docstring says what each "
        f"column checks); the same job as above. Machine: {platform.machine()}, "
        f"{os.cpu_count()} CPUs, {platform.python_version()}{note}; {seconds / 60:.1f} min.",
        "",
        "| family | first exit | runs to finish | fingerprint | exports + registry | MLflow "
        "| Prefect states | truthful |",
        "|---|---:|---:|---|---|---|---|---|",
    ]
    for r in results:
        cells = ["ok" if r[c]["ok"] else f"FAIL: {r[c]['detail']}" for c in cols]
        lines.append(
            f"| {r['family']}: {FAMILIES[r['family']]} | {r['first_rc']} | {r['attempts']} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--families", nargs="*", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--out", default=str(ROOT / "FAULTS.md"), help="appended to")
    parser.add_argument("--workdir", default=None, help="keep storage, logs and stores here")
    parser.add_argument("--note", default="", help="said of the machine in the table's header")
    args = parser.parse_args()
    started = time.monotonic()
    with (
        contextlib.nullcontext(args.workdir)
        if args.workdir
        else tempfile.TemporaryDirectory(prefix="prefect-jax-damage-")
    ) as tmp:
        work = Path(tmp)
        (work / "logs").mkdir(parents=True, exist_ok=True)
        server = PrefectServerProcess(work / "prefect")
        try:
            server.wait_healthy()
            ctx = {
                "work": work,
                "api_url": server.api_url,
                "s3": None,
                "mlflow_uri": f"sqlite:///{work}/mlflow.db",
            }
            ctx["reference"] = reference_run(ctx, remote=False)
            results = []
            for family in args.families:
                results.append(run_family(family, ctx))
                print(json.dumps(results[-1]), flush=True)
        finally:
            server.stop()
    text = markdown(results, time.monotonic() - started, f" ({args.note})" if args.note else "")
    with open(args.out, "a") as f:
        f.write(text)
    print(text)
    passed = sum(all(r[c]["ok"] for c in (*CHECKS[:4], "truthful")) for r in results)
    print(json.dumps({"families": len(results), "all_checks_passed": passed}))


if __name__ == "__main__":
    main()
