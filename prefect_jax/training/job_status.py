"""What `prefect-jax status` shows of a job, read from its storage alone (and MLflow's registry):
its committed, evaluated and exported steps, goodput, program params, who trains it now (its
lease), damaged records and registered model. `prefect_jax.training.facade.job_status` is the
command's door to it."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from prefect_jax.training.control import stop_path, stop_requested
from prefect_jax.training.exporters import list_exports
from prefect_jax.training.goodput import read_ledger
from prefect_jax.training.goodput_summary import summarize
from prefect_jax.training.local_processes import holder_gone
from prefect_jax.training.names import (
    ATTEMPTS_FILE,
    BEST_FILE,
    EXPORT_INFO_FILE,
    GOODPUT_FILE,
    LEASE_FILE,
    REGISTRY_FILE,
    STOP_FILE,
)
from prefect_jax.training.program_params import META_KEY
from prefect_jax.training.records import damaged_records
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.resume_checks import DATA_KEY
from prefect_jax.training.steps import job_committed_steps, step_meta
from prefect_jax.training.storage import JobStorage


def job_status(
    job: str, url: str, options: Mapping[str, Any] | None = None, shown: str | None = None
) -> dict[str, Any]:
    """`prefect_jax.training.facade.job_status`: what storage holds of a job (see there).

    Raises:
        FileNotFoundError: No such job there; the message names the jobs that are, or the file
            where a folder of local storage would be.
        RemoteConfigError, RemoteUnreachableError: The storage cannot be read (an unknown
            protocol, no credentials, an endpoint that does not answer); the message says what
            to check.
    """
    from prefect_jax.training.preflight import storage_errors

    js = JobStorage(url, job, dict(options or {}))
    # the first reads: where the storage itself is wrong, one line says how
    with storage_errors(js, shown or url, doing="reading the job's records"):
        blocking = _file_in_the_way(js.job_dir) if js.protocol == "file" else None
        there = blocking is None and js.fs.exists(js.job_dir)
    if blocking is not None:
        raise FileNotFoundError(
            f"storage {js.root}: {blocking} is a file, not a folder, so no job {job!r} is there; "
            "check --job and --storage"
        )
    if not there:
        where = redact_url(js.root)
        where = where if shown in (None, url) else f"{shown} ({where})"
        raise FileNotFoundError(
            f"no job {job!r} in storage {where} ({js.jobs_there_said()}); check --job and --storage"
        )
    committed = job_committed_steps(js)
    names = js.eval_names()
    status: dict[str, Any] = {
        "storage": js.root,
        "committed_steps": committed,
        "evaluated_steps": {n: js.list_int_names(js.eval_dir(n)) for n in names},
        "exports": list_exports(js),
        "goodput": summarize(read_ledger(js)),
    }
    if committed:
        newest_meta = step_meta(js, committed[-1]) or {}
        recorded_params = newest_meta.get(META_KEY)
        if recorded_params is not None:
            status["program_params"] = recorded_params.get("values", {})
        if newest_meta.get(DATA_KEY) is not None:  # what its data was (`resume_checks`)
            status["data_fingerprint"] = newest_meta[DATA_KEY]
    stop = stop_requested(js)
    if stop is not None:  # (TF had no such state; a rerun trains nothing until it is deleted)
        status["stop_requested"] = {
            "step": stop.get("step"),  # (None in a damaged file: its reason says so)
            "by": stop.get("by"),
            "reason": stop.get("reason"),
            "path": redact_url(stop_path(js)),
        }
    # Records that are not JSON, each named with what becomes of it (issue 53).
    damaged = damaged_records(js)
    if damaged:
        status["damaged_records"] = [dict(d, fix=damage_fix(d["path"])) for d in damaged]
    lease = js.path(LEASE_FILE)
    if not any(d["path"] == lease for d in damaged):
        try:
            status["trainer"] = trainer_status(js.read_json(lease))
        except Exception as exc:  # noqa: BLE001 - the rest of the status still shows
            status["trainer_unread"] = f"{redact_url(lease)}: {type(exc).__name__}: {exc}"
    registry = js.path(REGISTRY_FILE)
    recorded = None if any(d["path"] == registry for d in damaged) else js.read_json(registry)
    if recorded:
        status["registered_model"] = registry_status(recorded, js.job_dir)
    return status


def trainer_status(lease: dict | None) -> dict[str, Any] | None:
    """Who trains the job now, from its lease (an operator's first question after a
    `LeaseHeldError`): the holder's flow run, host, pid and heartbeat age, and ``gone`` (why it
    writes no more: a stale heartbeat, a dead process on this host; None while it lives); None
    where no trainer holds the lease."""
    if not lease:
        return None
    return {
        "flow_run_id": lease.get("flow_run_id"),
        "host": lease.get("host"),
        "pid": lease.get("pid"),
        "heartbeat_age_secs": round(time.time() - float(lease.get("heartbeat") or 0), 1),
        "finishing": bool(lease.get("finishing")),
        "gone": holder_gone(lease, float(lease.get("timeout_secs", 0))),
    }


def damage_fix(path: str) -> str:
    """What becomes of a damaged record of the job, or what to do about it."""
    name = path.rsplit("/", 1)[-1]
    if "/evals/" in path:
        return "the job's next run moves it aside and evaluates that step again if it is committed"
    if name == GOODPUT_FILE:
        return "the job's next run moves it aside (kept) and starts the ledger again"
    if name == REGISTRY_FILE:
        return (
            "the job's next export writes it again from MLflow's registry; delete it to see the "
            "rest of this status"
        )
    if name == BEST_FILE:
        return "the next export rebuilds it from the kept exports' export.json (kept aside)"
    if name == EXPORT_INFO_FILE:
        return (
            "that export is left out where its record is read (a rebuilt best.json; its model is "
            "registered without this metadata); delete the export's directory to drop it"
        )
    if name == STOP_FILE:
        return "read as a stop request: delete it to let the job run on"
    if name == ATTEMPTS_FILE:
        return "the next trainer moves it aside (kept) and counts reruns anew"
    if name == LEASE_FILE:
        return (
            "held by an unknown trainer until it goes stale (a live holder writes it again at its "
            "next heartbeat); delete it only when no trainer of the job runs"
        )
    return "move it aside or delete it; the job writes it again when it next needs it"


def registry_status(recorded: dict, job_key: str) -> dict[str, Any]:
    """The job's versions and aliases in the MLflow Model Registry, read from MLflow (the copy the
    job last recorded in its storage if MLflow cannot be reached)."""
    name, uri = recorded["name"], recorded["tracking_uri"]
    out = {
        "name": name,
        "tracking_uri": redact_url(uri),
        # step order (registry.json, like every JSON object, keys them by strings: "100" < "20")
        "versions": dict(sorted(recorded["versions"].items(), key=lambda kv: int(kv[0]))),
        "aliases": recorded["aliases"],
    }
    try:
        from mlflow.tracking import MlflowClient

        from prefect_jax.training.registry_search import job_versions

        client = MlflowClient(uri)
        versions = job_versions(client, name, job_key)
        mine = {str(v.version) for v in versions.values()}
        aliases = {
            a: str(v)
            for a, v in (client.get_registered_model(name).aliases or {}).items()
            if str(v) in mine
        }
        out.update(
            versions={str(s): str(v.version) for s, v in sorted(versions.items())},
            aliases=dict(sorted(aliases.items())),
        )
    except Exception as exc:  # noqa: BLE001 - status still shows what the job recorded
        out["note"] = f"MLflow not reachable ({type(exc).__name__}): as last recorded by the job"
    return out


def _file_in_the_way(job_dir: str) -> str | None:
    """The file at a local job's folder `job_dir` or at one of its parent folders, if one is:
    where the job could not be (a status that says "no job there" would not say why)."""
    path = job_dir
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path if os.path.exists(path) and not os.path.isdir(path) else None
