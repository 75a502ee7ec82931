"""``prefect-jax status``: a job's committed, evaluated and exported steps, its goodput and its
registered model, read from its storage (and MLflow); no Prefect server needed."""

from __future__ import annotations

import argparse
import json
from typing import Any


def job_status(job: str, storage: str) -> dict[str, Any]:
    """Committed steps, evaluated steps per eval name, and exports of a job (`storage`: a URL or
    ``jax-checkpoint-storage/<block>``), with the resource id its events carry."""
    from prefect_jax.blocks import BLOCK_PREFIX, resolve_storage
    from prefect_jax.deployments import job_resource_id
    from prefect_jax.training import facade

    url, options = resolve_storage(storage)
    if storage.startswith(BLOCK_PREFIX):  # loaded from Prefect: its load's event goes out now
        from prefect_jax.cli.server import send_prefect_events

        send_prefect_events()
    found = facade.job_status(job, url, options, shown=storage)
    status = {
        "job": job,
        "storage": found.pop("storage"),
        "event_resource_id": job_resource_id(job, url),
    }
    status.update(found)
    return status


def cmd_status(args: argparse.Namespace) -> int:
    """``status``: print `job_status` (as one JSON object with ``--json``)."""
    status = job_status(args.job, args.storage)
    if args.json:
        print(json.dumps(status))  # (in `job_status`'s order: versions by step, not as text)
        return 0
    print(f"job {status['job']} in {status['storage']}")
    print(f"  event resource id: {status['event_resource_id']}  (a deployment trigger's match)")
    print(f"  committed steps: {status['committed_steps'] or 'none'}")
    for name, steps in status["evaluated_steps"].items() or [("eval", [])]:
        print(f"  evaluated ({name}): {steps or 'none'}")
    for name, steps in status["exports"].items():
        print(f"  exports ({name}): {steps}")
    from prefect_jax.training.facade import describe_goodput

    print(f"  goodput: {describe_goodput(status['goodput'])}")
    if status.get("program_params"):
        given = ", ".join(f"{k}={json.dumps(v)}" for k, v in status["program_params"].items())
        print(f"  program params (newest step): {given}")
    if status.get("data_fingerprint"):
        print(f"  data (newest step): {status['data_fingerprint']}")
    stop = status.get("stop_requested")
    if stop:
        at = f" at step {stop['step']}" if stop["step"] is not None else ""
        by = f" by {stop['by']}" if stop["by"] else ""
        print(
            f"  stopped: asked{at}{by}: {stop['reason']}; its roles train and evaluate nothing "
            f"more until {stop['path']} is deleted"
        )
    if "trainer" in status:  # (absent: its lease file is damaged, said below)
        print(f"  trainer: {describe_trainer(status['trainer'])}")
    if "trainer_unread" in status:
        print(f"  trainer: unknown, its lease could not be read ({status['trainer_unread']})")
    registry = status.get("registered_model")
    if registry:
        versions = ", ".join(f"v{v} (step {s})" for s, v in registry["versions"].items()) or "none"
        aliases = ", ".join(f"@{a} = v{v}" for a, v in registry["aliases"].items()) or "none"
        print(
            f"  registered model {registry['name']} ({registry['tracking_uri']}): {versions}; "
            f"aliases {aliases}"
        )
        if registry.get("note"):
            print(f"    {registry['note']}")
    for damaged in status.get("damaged_records", []):
        print(f"  DAMAGED {damaged['path']}: {damaged['error']}\n    {damaged['fix']}")
    return 0


def describe_trainer(trainer: dict | None) -> str:
    """The job's lease holder in one line: who trains it now, or that nothing does."""
    if trainer is None:
        return "none (no trainer holds the job's lease)"
    run = trainer["flow_run_id"]
    who = f"flow run {run}" if run else "a process outside any flow run"
    who += f" on {trainer['host']} (pid {trainer['pid']})"
    beat = f"heartbeat {trainer['heartbeat_age_secs']:.0f}s ago"
    if trainer["gone"]:
        return f"none: {who} left its lease ({trainer['gone']}); the next trainer takes it over"
    finishing = ", finishing its last writes" if trainer["finishing"] else ""
    return f"{who}, {beat}{finishing}"
