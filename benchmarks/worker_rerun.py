"""Reruns the way a deployment gets them: a process worker and the rerun automation.

A standing ``prefect server``, a ``process`` work pool, the `train` flow deployed to it
(`bench_programs:wide`, the goodput benchmark's MLP, a checkpoint every 500 steps, JAX's
compilation cache in the job), `prefect_jax.deployments.automations`' rerun automation and
``prefect worker start --pool cpu``. One flow run of the deployment; each time its newest
process has committed a checkpoint of its own, the harness waits 2 s and SIGKILLs that process
(a spot node's kill; the worker lives on and reports the run Crashed), ``--kills`` times, then
lets the run finish. For each worker poll period (``PREFECT_WORKER_QUERY_SECONDS``, one run each):

- ``kill_to_process_s``: from the kill to the rerun's process start: the worker's crash report,
  the automation (AwaitingRetry), the worker's next poll, the process's spawn;
- ``process_to_first_step_s``: from the process start to the end of its first new step
  (imports, the flow run, restore, the step's cache load), from the job's goodput ledger;
- ``kill_to_first_step_s``: the two together: what a preemption costs beyond the lost steps;
- ``second_starts``: the "already trains job" lines in the worker's log: a process of the run
  started while a rerun of it ran (Prefect's process worker reports one SIGKILL Crashed twice,
  and the automation reacts to each) waits for the first, and logs it (once before it starts
  JAX, again if it waits once more for the lease); a rerun by such a process is marked
  ``waited_for_another`` (its ``kill_to_process_s`` runs to the end of its wait); ``errors``
  counts ERROR lines in the worker's log (two processes writing one job showed there).

    uv run python benchmarks/worker_rerun.py [--query-seconds 10,2] [--kills 4]

Progress goes to stderr; the last stdout line is one JSON object (also --out).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

from deployment_helpers import PrefectServerProcess, trainer_on_process_worker  # noqa: E402

EVERY = 500


def log(msg: str) -> None:
    print(f"[worker_rerun] {msg}", file=sys.stderr, flush=True)


def _ledger(job_dir: Path) -> list[dict]:
    try:
        return json.loads((job_dir / "goodput.json").read_text())["attempts"]
    except (FileNotFoundError, ValueError, KeyError):
        return []


def _first_step_at(attempt: dict) -> float:
    s = attempt["seconds"]
    return attempt["process_start"] + s["startup"] + s["restore"] + s.get("compile", 0.0)


def run_one(query_seconds: str, kills: int, work: Path, api: str, pool: str) -> dict:
    """One flow run on a worker polling every `query_seconds`, killed `kills` times."""
    from prefect.client.orchestration import get_client

    storage = work / f"storage-{pool}"
    job_dir = storage / "bench"
    params = {
        "program": "bench_programs:wide",
        "job": "bench",
        "storage": str(storage),
        "train_spec": {"max_steps": EVERY * (kills + 2)},
        "checkpoint_spec": {"every_steps": EVERY},
        "mlflow_tracking_uri": f"sqlite:///{work}/mlflow-{pool}.db",
        "compilation_cache_dir": "job",
    }
    deployment_id, worker = trainer_on_process_worker(
        api,
        pool,
        f"bench-{pool}",
        params,
        work / f"worker-{pool}",
        work / f"worker-{pool}.log",
        query_seconds=query_seconds,
        paths=[str(HERE)],
        PREFECT_JAX_MLFLOW_STRICT=None,  # not strict, as users run it
    )
    try:
        with get_client(sync_client=True) as client:
            run = client.create_flow_run_from_deployment(deployment_id)
            killed: dict[int, float] = {}
            deadline = time.monotonic() + 900
            while len(killed) < kills and time.monotonic() < deadline:
                attempts = _ledger(job_dir)
                newest = attempts[-1] if attempts else None
                # The newest process, once it has committed a checkpoint of its
                # own: 2 s into its next interval.
                if (
                    newest
                    and newest["pid"] not in killed
                    and newest["step"] > newest["from_step"]
                    and not newest.get("ended")
                ):
                    time.sleep(2.0)
                    try:
                        os.kill(newest["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    killed[newest["pid"]] = time.time()
                    log(
                        f"poll {query_seconds}s: SIGKILL {newest['pid']} "
                        f"(step {newest['step']} committed)"
                    )
                time.sleep(0.1)
            while time.monotonic() < deadline:
                state = client.read_flow_run(run.id).state
                if state.is_final() and not state.is_crashed():
                    break
                time.sleep(1)
        time.sleep(
            3
        )  # a second process of the run, if one waits, ends once it sees the job finished
    finally:
        worker.stop()
    text = worker.tail(5_000_000)
    attempts = _ledger(job_dir)
    reruns = []
    for at, (pid, when) in enumerate(sorted(killed.items(), key=lambda kv: kv[1])):
        after = [a for a in attempts if a["pid"] != pid and _first_step_at(a) > when]
        if not after:
            continue
        nxt = min(after, key=_first_step_at)
        reruns.append(
            {
                "kill": at + 1,
                "kill_to_process_s": nxt["process_start"] - when,
                "process_to_first_step_s": _first_step_at(nxt) - nxt["process_start"],
                "kill_to_first_step_s": _first_step_at(nxt) - when,
                "waited_for_another": bool(nxt.get("waited_for_another_process")),
                **{f"{k}_s": nxt["seconds"].get(k, 0.0) for k in ("startup", "restore", "compile")},
            }
        )
    return {
        "query_seconds": float(query_seconds),
        "state": state.type.value,
        "final_step": attempts[-1]["step"] if attempts else None,
        "kills": len(killed),
        "reruns": reruns,
        "second_starts": text.count("already trains job"),
        "errors": sum(1 for line in text.splitlines() if "| ERROR" in line),
        **{
            f"{k}_mean": statistics.mean(r[k] for r in reruns)
            for k in ("kill_to_process_s", "process_to_first_step_s", "kill_to_first_step_s")
            if reruns
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--query-seconds", default="10,2", help="worker poll periods, one run each (default 10,2)"
    )
    parser.add_argument("--kills", type=int, default=4, help="SIGKILLs per run (default 4)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prefect-jax-worker-rerun-"))
    server = PrefectServerProcess(work / "server")
    try:
        server.wait_healthy()
        os.environ.update(PREFECT_API_URL=server.api_url, PREFECT_HOME=str(work / "home"))
        results = [
            run_one(q.strip(), args.kills, work, server.api_url, f"pool-{i}")
            for i, q in enumerate(args.query_seconds.split(","))
        ]
    finally:
        server.stop()
    for r in results:
        log(
            f"poll {r['query_seconds']:g}s: {r['state']}, kill -> first new step "
            f"{r.get('kill_to_first_step_s_mean', float('nan')):.2f}s "
            f"(to the process {r.get('kill_to_process_s_mean', float('nan')):.2f}s), "
            f"second starts {r['second_starts']}, errors {r['errors']}"
        )
    out = {
        "measured": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "program": "bench_programs:wide",
        "every_steps": EVERY,
        "runs": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
