"""The fault sweep's MLflow families (issue 53), run by `benchmarks/faults_damage.py`:

- ``mlflow_restart``: the job tracks to a standing ``mlflow server`` (SQLite backend, started
  here); once step 100's train metrics are in its store the server is SIGKILLed, and started
  again on the same port some seconds later. The run must end 0 with nothing missing from its
  summary, and the server's run must hold what the uninterrupted run's holds: the same metric
  keys, each with the same steps, no point twice; the same params; one registered version per
  export, as the uninterrupted run.
- ``mlflow_unreachable``: the tracking URI is a closed port. The run must refuse before any
  training (non-zero exit, no job directory, a message naming the URI and ``--mlflow-optional``);
  with ``--mlflow-optional`` it trains to the end, exit 0, and its summary's ``mlflow_missing``
  says nothing reached MLflow (no run, no registered model).

Each returns the same columns as the other damage families (`faults_damage.run_family`).
"""

from __future__ import annotations

import sys
import time
from collections import Counter

import faults_job  # the job and its checks
from faults import TESTS, _start, _wait
from faults_job import EVERY

sys.path.insert(0, str(TESTS))
from deployment_helpers import free_port  # noqa: E402
from mlflow_server import MlflowServerProcess  # noqa: E402

FAMILIES = {
    "mlflow_restart": f"the `mlflow server` SIGKILLed once step {EVERY}'s metrics landed, "
    "back on its port after 15 s",
    "mlflow_unreachable": "the tracking URI a closed port: refused; with --mlflow-optional "
    "trained, nothing in MLflow said",
}
DOWN_SECS = 15.0
SKIPPED = ("system/",)  # MLflow's system metrics: sampled by the clock, not by the step


def _contents(uri: str, run_id: str) -> dict:
    """What MLflow holds of a run: each metric key's steps (with repeats), the param keys, and
    the number of versions of each registered model whose versions came from the run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    metrics = {
        k: sorted(m.step for m in client.get_metric_history(run_id, k))
        for k in run.data.metrics
        if not k.startswith(SKIPPED)
    }
    versions = Counter(
        v.name for v in client.search_model_versions(f"run_id = '{run_id}'", max_results=1000)
    )
    return {
        "status": run.info.status,
        "metrics": metrics,
        "params": sorted(run.data.params),
        "versions": dict(sorted(versions.items())),
    }


def _same_contents(got: dict, ref: dict) -> tuple[bool, str]:
    problems = []
    if got["status"] != "FINISHED":
        problems.append(f"status {got['status']}")
    for key in sorted(set(got["metrics"]) | set(ref["metrics"])):
        steps, want = got["metrics"].get(key), ref["metrics"].get(key)
        if steps != want:
            twice = sorted(s for s, n in Counter(steps or []).items() if n > 1)
            missing = sorted(set(want or []) - set(steps or []))
            problems.append(f"{key}: twice at {twice}, missing {missing}")
    if got["params"] != ref["params"]:
        problems.append(f"params differ: {sorted(set(got['params']) ^ set(ref['params']))}")
    if sorted(got["versions"].values()) != sorted(ref["versions"].values()):
        problems.append(f"registered versions {got['versions']} (uninterrupted {ref['versions']})")
    return not problems, "; ".join(problems)


def _row(family, job, rc1, attempts, row) -> dict:
    return {
        "family": family,
        "job": job,
        "first_rc": rc1,
        "attempts": attempts,
        **{k: {"ok": ok, "detail": d} for k, (ok, d) in row.items()},
    }


def mlflow_restart(ctx: dict) -> dict:
    job, work = "mlflow-restart", ctx["work"]
    storage = str(work / "storage")
    env = faults_job.environment(ctx["api_url"], None, work / "cache" / job)
    server = MlflowServerProcess(work, free_port(), log_dir=work / "logs")
    server.start()
    detail, truthful = [], True
    try:
        args = faults_job.command(job, storage, server.uri)
        first = work / "logs" / f"{job}-1.log"
        proc = _start(args, env, first)
        deadline, hit = time.monotonic() + 600, False
        while time.monotonic() < deadline and proc.poll() is None:
            if server.last_step("train/loss") >= EVERY:
                hit = True
                break
            time.sleep(0.05)
        if hit:
            server.kill()
            time.sleep(DOWN_SECS)
            server.start()
        rc1 = _wait(proc, 900)
        summary = faults_job.last_json(first) if rc1 == 0 else None
        attempts = 1
        while summary is None and attempts < 4:  # as the other families: rerun until it ends 0
            attempts += 1
            log = work / "logs" / f"{job}-{attempts}.log"
            if _wait(_start(args, env, log), 900) == 0:
                summary = faults_job.last_json(log)
        if not hit:
            truthful = False
            detail.append(f"the moment was missed (step {EVERY} never reached the server)")
        if rc1 != 0:
            truthful = False
            detail.append(f"the run the outage met exited {rc1}")
        if summary is not None:
            summary["best"] = faults_job.best_record(job, ctx, False)
            if summary.get("mlflow_missing"):
                truthful = False
                detail.append(f"the summary says: {summary['mlflow_missing']}")
        row = faults_job.outcome(
            job, storage, summary, ctx["reference"], server.uri, ctx["api_url"], env
        )
        if summary is not None and summary.get("mlflow_run_id"):
            ref = _contents(ctx["mlflow_uri"], ctx["reference"]["mlflow_run_id"])
            ok, why = _same_contents(_contents(server.uri, summary["mlflow_run_id"]), ref)
            if not ok:
                old_why = row["mlflow"][1]
                row["mlflow"] = (False, "; ".join(x for x in (old_why, why) if x))
        row["truthful"] = (truthful, "; ".join(detail))
    finally:
        server.kill()
    return _row("mlflow_restart", job, rc1, attempts, row)


def mlflow_unreachable(ctx: dict) -> dict:
    job, work = "mlflow-unreachable", ctx["work"]
    storage = str(work / "storage")
    job_dir = work / "storage" / job
    env = faults_job.environment(ctx["api_url"], None, work / "cache" / job)
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    detail, truthful = [], True
    first = work / "logs" / f"{job}-1.log"
    rc1 = _wait(_start(faults_job.command(job, storage, uri), env, first), 600)
    text = first.read_text(errors="replace")
    named = f"--mlflow-tracking-uri {uri}" in text and "--mlflow-optional" in text
    trained = "training from step" in text
    if rc1 == 0 or not named or trained or job_dir.exists():
        truthful = False
        detail.append(
            f"refusal: exit {rc1}, URI and --mlflow-optional named: {named}, trained: {trained}, "
            f"job directory written: {job_dir.exists()}"
        )
    second = work / "logs" / f"{job}-2.log"
    rc2 = _wait(
        _start([*faults_job.command(job, storage, uri), "--mlflow-optional"], env, second), 900
    )
    summary = faults_job.last_json(second) if rc2 == 0 else None
    if summary is not None:
        summary["best"] = faults_job.best_record(job, ctx, False)
    row = faults_job.outcome(job, storage, summary, ctx["reference"], uri, ctx["api_url"], env)
    if summary is None:
        truthful = False
        detail.append(f"--mlflow-optional: exit {rc2}")
    else:
        missing = summary.get("mlflow_missing") or ""
        if not missing.startswith(f"nothing of this run reached MLflow at {uri}"):
            truthful = False
            detail.append(f"mlflow_missing: {missing!r}")
        # Nothing reached MLflow: no run, no registered model; the exports are the same.
        registered = (job_dir / "registry.json").exists()
        ok = summary.get("mlflow_run_id") is None and not registered
        row["mlflow"] = (
            ok,
            "" if ok else f"run {summary.get('mlflow_run_id')}, registry.json: {registered}",
        )
        if not row["exports"][0]:  # (the registry: none is right here)
            ref = ctx["reference"]
            status = faults_job.job_status(job, storage, env)["exports"]
            ok = status == ref["exports"] and summary.get("best") == ref["best"]
            row["exports"] = (ok, "" if ok else f"{status} best {summary.get('best')}")
    row["truthful"] = (truthful, "; ".join(detail))
    return _row("mlflow_unreachable", job, rc1, 2, row)


RUNS = {"mlflow_restart": mlflow_restart, "mlflow_unreachable": mlflow_unreachable}
