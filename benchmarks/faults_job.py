"""The fault sweep's job (`faults.py`): its command and environment, and what a finished run of
it must show against the uninterrupted run of the same job (the table's columns, `CHECKS`; what
each checks is `faults.py`'s docstring)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))

from process_helpers import job_args  # noqa: E402
from process_helpers import status as job_status  # noqa: E402
from s3_server import ACCESS_KEY, ISOLATED_AWS_ENV, SECRET_KEY, UNSET_AWS_ENV, S3Server  # noqa: E402

PROGRAM = "programs:big"
MAX_STEPS, EVERY, LOG_EVERY = 400, 100, 10
STEPS = list(range(EVERY, MAX_STEPS + 1, EVERY))
CHECKS = (
    "fingerprint",
    "exports",
    "mlflow",
    "prefect",
    "notice",
)  # the table's columns, in the docstring's order


def environment(api_url: str, s3: S3Server | None, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in UNSET_AWS_ENV and k != "PREFECT_API_URL"}
    env.update(ISOLATED_AWS_ENV)
    env.update(
        PREFECT_API_URL=api_url,
        PREFECT_LOGGING_LEVEL="INFO",
        PREFECT_JAX_CACHE_DIR=str(cache),
        PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]),
    )
    if s3 is not None:
        env.update(
            AWS_ACCESS_KEY_ID=ACCESS_KEY,
            AWS_SECRET_ACCESS_KEY=SECRET_KEY,
            FSSPEC_S3_ENDPOINT_URL=s3.endpoint_url,
        )
    return env


def command(job: str, storage: str, mlflow_uri: str) -> list[str]:
    """``python -m prefect_jax.cli run`` of the sweep's job (the tests' flags, `job_args`)."""
    cadence = ("--log-every-steps", str(LOG_EVERY), "--keep-last", "10")
    args = job_args(PROGRAM, job, storage, MAX_STEPS, EVERY, mlflow_uri, *cadence)
    return [sys.executable, "-m", "prefect_jax.cli", "run", *args]


def last_json(log: Path) -> dict | None:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def mlflow_check(mlflow_uri: str, run_id: str, evaluated: list[int]) -> tuple[bool, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    run = client.get_run(run_id)
    problems = []
    if run.info.status != "FINISHED":
        problems.append(f"status {run.info.status}")
    for key in ("eval/loss", "eval/accuracy"):
        steps = sorted(m.step for m in client.get_metric_history(run_id, key))
        if steps != evaluated:
            problems.append(f"{key} at {steps}")
    expected_train = list(range(LOG_EVERY, MAX_STEPS + 1, LOG_EVERY))
    for key in ("train/loss", "train/accuracy"):
        steps = sorted(m.step for m in client.get_metric_history(run_id, key))
        if steps != expected_train:
            extra = sorted({s for s in steps if steps.count(s) > 1})
            missing = sorted(set(expected_train) - set(steps))
            problems.append(f"train {key}: twice at {extra}, missing {missing}")
    return not problems, "; ".join(problems)


def prefect_check(api_url: str, job: str) -> tuple[bool, str]:
    import httpx

    flow_runs = httpx.post(
        f"{api_url}/flow_runs/filter",
        # By name, not by the job's tag: a run killed before its first task was never tagged.
        json={
            "flow_runs": {"name": {"any_": [f"train-and-evaluate-{job}"]}},
            "sort": "EXPECTED_START_TIME_ASC",
            "limit": 50,
        },
        timeout=30,
    ).json()
    if not flow_runs:
        return False, "no flow run of the job"
    problems = []
    states = [fr["state_type"] for fr in flow_runs]
    if states[-1] != "COMPLETED":
        problems.append(f"last flow run {states[-1]}")
    if any(s not in ("CRASHED", "FAILED") for s in states[:-1]):
        problems.append(f"earlier flow runs {states[:-1]}")
    task_runs = httpx.post(
        f"{api_url}/task_runs/filter",
        json={
            "flow_runs": {"id": {"any_": [fr["id"] for fr in flow_runs]}},
            "sort": "EXPECTED_START_TIME_ASC",
            "limit": 200,
        },
        timeout=30,
    ).json()
    stuck = [
        f"{tr['name']}: {tr['state_type']}"
        for tr in task_runs
        if tr["state_type"] in ("RUNNING", "PENDING")
    ]
    if stuck:
        problems.append(f"task runs left {stuck}")
    return not problems, "; ".join(problems) or f"{len(flow_runs)} flow runs: {'/'.join(states)}"


def outcome(
    job: str,
    storage: str,
    summary: dict | None,
    reference: dict,
    mlflow_uri: str,
    api_url: str,
    env,
) -> dict:
    """The four checks of one finished job against the reference."""
    status = job_status(job, storage, env)
    row: dict = {}
    if summary is None:
        return {
            "fingerprint": (False, "the rerun printed no summary"),
            "exports": (False, ""),
            "mlflow": (False, ""),
            "prefect": prefect_check(api_url, job),
        }
    same_fp = summary.get("state_fingerprint") == reference["state_fingerprint"]
    fp_problems = [] if same_fp else ["fingerprint differs"]
    # A SIGTERM mid-interval commits the step in flight too (a
    # preemption checkpoint, off the cadence).
    if [s for s in status["committed_steps"] if s % EVERY == 0] != STEPS:
        fp_problems.append(f"committed {status['committed_steps']}")
    if status["evaluated_steps"].get("eval") != STEPS:
        fp_problems.append(f"evaluated {status['evaluated_steps']}")
    row["fingerprint"] = (not fp_problems, "; ".join(fp_problems))
    registry = {k: status.get("registered_model", {}).get(k) for k in ("versions", "aliases")}
    same_exports = (
        status["exports"] == reference["exports"]
        and summary.get("best") == reference["best"]
        and registry == reference["registry"]
    )
    row["exports"] = (
        same_exports,
        ""
        if same_exports
        else f"{status['exports']} best {summary.get('best')} registry {registry}",
    )
    row["mlflow"] = (
        mlflow_check(
            mlflow_uri, summary["mlflow_run_id"], status["evaluated_steps"].get("eval", [])
        )
        if summary.get("mlflow_run_id")
        else (False, f"no MLflow run: {summary.get('mlflow_missing')}")
    )
    row["prefect"] = prefect_check(api_url, job)
    return row


def best_record(job: str, ctx: dict, remote: bool) -> dict | None:
    """The best exporter's record (best.json) of a job."""
    if remote:
        fs, path = ctx["s3"].filesystem(), f"faults/sweep/{job}/exports/best/best.json"
    else:
        import fsspec

        fs, path = (
            fsspec.filesystem("file"),
            str(ctx["work"] / "storage" / job / "exports" / "best" / "best.json"),
        )
    try:
        with fs.open(path, "r") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
