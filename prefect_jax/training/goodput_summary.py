"""Goodput's summary: from a job's ledger, the share of its wall time in kept steps and where
the rest went.

The ledger (`prefect_jax.training.goodput`) holds one entry per attempt, its seconds by phase.
The next attempt learns from the step it restores which of the previous attempt's steps were
kept; steps trained past it were lost and count as *recomputed*.

Phases of an attempt (seconds):

- ``startup``: from the process start to the restore (interpreter, imports, the Prefect flow
  run and its task run, the program, Orbax and MLflow clients);
- ``restore``: taking the lease and restoring the newest committed step (or init);
- ``compile``: waiting for the train step's compile (or its load from the cache) and running
  the first step;
- ``train``: the training loop; split later into kept and ``recomputed``;
- ``checkpoint``: the training thread blocked by saves and waiting for commits;
- ``eval`` and ``export``: evaluations and exports run by the trainer (local mode);
- ``other``: the rest of the attempt (Prefect task runs and state changes, MLflow waits);
- ``between_attempts``: from an attempt's last record to the next attempt's process start:
  work done after the last checkpoint of a killed process, its exit, and the wait for a rerun.

``goodput = kept train seconds / wall seconds`` from the first attempt's process start to the
last record. A job is not waiting while it is finished: the time between an attempt that
finished and the next (a rerun with a larger ``max_steps``, days later) is neither wall nor
lost, and a rerun of a finished job that trains nothing (it restores the last step and stops,
as a rerun from the UI of a completed run does) is left out of the account. This module never
imports prefect.
"""

from __future__ import annotations

from typing import Any

from prefect_jax.training.names import GOODPUT_PREFIX

# How an attempt ended: its ledger entry's ``ended`` (None: it never said, it was killed without
# notice). Written by `GoodputLedger.end`, read here, by the backup policy and by the flows' hooks.
FINISHED = "finished"
PREEMPTED = "preempted"  # a preemption notice: the step in flight was checkpointed
FAILED = "failed"
CLOSED = "closed"  # the trainer was closed without finishing, as a notebook may
# Another process of the job went away mid-collective: process 0's attempt counts as killed
# without notice, as if it were (`policy.backup_interval`).
LOST_PROCESS = "lost a process"
# The MLflow status a trainer finishes with, as its attempt's end.
ENDED_BY_STATUS = {"FINISHED": FINISHED, "KILLED": PREEMPTED, "FAILED": FAILED}

PHASES = ("startup", "restore", "compile", "train", "checkpoint", "eval", "export")
# Where an account's lost seconds go (its ``lost_s`` keys, in order), as the goodput table says.
LOSSES = {
    "startup": "start-up (process, imports, Prefect, clients)",
    "restore": "restore (lease, checkpoint read, or init)",
    "compile": "compile (or cache load) and first step",
    "recomputed": "recomputed steps (trained, then lost)",
    "checkpoint": "checkpoint stall (save, wait for commit)",
    "eval": "evaluation",
    "export": "export",
    "other": "orchestration (task runs, MLflow waits)",
    "between_attempts": "between attempts (killed work, exit, rerun wait)",
}


def _train_at(attempt: dict, step: int) -> float | None:
    """The attempt's cumulative train seconds when it saved `step` (None: not one of its newest
    saves)."""
    for s, secs in reversed(attempt.get("tail", [])):
        if s == step:
            return secs
    return None


def _rerun_of_finished_job(previous: dict, attempt: dict) -> bool:
    """`attempt` came after `previous` finished the job and trained nothing: it restored the last
    step and stopped (a rerun of a completed run). It cost no one any waiting for the job."""
    return (
        previous.get("ended") == FINISHED
        and attempt.get("ended") == FINISHED
        and attempt["from_step"] == attempt["step"] == previous["step"]
        and not attempt["seconds"].get("train")
    )


def counted_attempts(attempts: list[dict]) -> list[dict]:
    """The attempts the account counts: not the reruns of a finished job that trained nothing."""
    return [
        a
        for i, a in enumerate(attempts)
        if i == 0 or not _rerun_of_finished_job(attempts[i - 1], a)
    ]


def running_account(attempts: list[dict], stop: int) -> dict[str, Any]:
    """The running account of ``attempts[:stop]``, each judged against the attempt after it (the
    last of the list against none: it is the newest). ``attempts[0]`` may be a fold, whose
    account is carried on from."""
    first = attempts[0]
    if "carried" in first:
        acc = {**first["carried"], "lost": dict(first["carried"]["lost"])}
    else:
        acc = {
            "productive": 0.0,
            "wall": 0.0,
            "lost": dict.fromkeys(LOSSES, 0.0),
            "attempts": 0,
            "interrupted": 0,
            "segment_start": first["process_start"],
            "from_step": first["from_step"],
        }
    lost = acc["lost"]
    for i in range(1 if "carried" in first else 0, stop):
        a = attempts[i]
        secs = a["seconds"]
        train = secs.get("train", 0.0)
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        if nxt is None:
            kept = train
        else:
            at = _train_at(a, nxt["from_step"])
            if at is None:  # the next attempt restored an older step than any this one recorded
                at = 0.0 if nxt["from_step"] <= a["from_step"] else train
            kept = min(train, at)
            # (at least: steps trained past its last checkpoint started were not recorded)
            again = max(0, int(a.get("step") or 0) - int(nxt["from_step"]))
            acc["recomputed_steps"] = acc.get("recomputed_steps", 0) + again
            if a.get("ended") != FINISHED:
                lost["between_attempts"] += max(0.0, nxt["process_start"] - a["updated"])
        if nxt is None or a.get("ended") == FINISHED:
            # The job waited from segment_start until here.
            acc["wall"] += a["updated"] - acc["segment_start"]
            acc["segment_start"] = nxt["process_start"] if nxt is not None else 0.0
        acc["productive"] += kept
        lost["recomputed"] += train - kept
        for phase in PHASES:
            if phase != "train":
                lost[phase] += secs.get(phase, 0.0)
        lost["other"] += max(0.0, (a["updated"] - a["process_start"]) - sum(secs.values()))
        acc["attempts"] += a.get("folded", 1)  # (an int in the folds of older versions)
        acc["interrupted"] += a.get("ended") not in (
            (FINISHED,) if nxt is not None else (FINISHED, None)
        )
    return acc


def summarize(ledger: dict[str, Any]) -> dict[str, Any]:
    """The job's goodput and where its lost time went, from its ledger.

    Returns ``{}`` for an empty ledger, else ``goodput``, ``wall_s``, ``productive_s``,
    ``lost_s`` (by cause, see the module), ``attempts``, ``interrupted`` (attempts that did not
    end by finishing) and ``steps`` (the step range the kept steps cover).
    """
    attempts = counted_attempts(ledger.get("attempts") or [])
    if not attempts:
        return {}
    acc = running_account(attempts, len(attempts))
    wall = acc["wall"]
    return {
        "goodput": acc["productive"] / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "productive_s": acc["productive"],
        "lost_s": {k: round(v, 3) for k, v in acc["lost"].items()},
        "attempts": acc["attempts"],
        "interrupted": acc["interrupted"],
        "steps": [acc["from_step"], attempts[-1]["step"]],
        # steps trained, lost and trained again (a team reads lost work in steps, not seconds)
        "recomputed_steps": acc.get("recomputed_steps", 0),
    }


def as_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The summary as table rows (``what``, ``seconds``, ``share of wall``), for people."""
    if not summary:
        return []
    wall = summary["wall_s"] or 1.0
    rows = [
        {
            "what": "productive training (steps kept)",
            "seconds": round(summary["productive_s"], 2),
            "share of wall": round(summary["productive_s"] / wall, 4),
        }
    ]
    for key, label in LOSSES.items():
        v = summary["lost_s"].get(key, 0.0)
        if key == "recomputed" and summary.get("recomputed_steps"):
            label = f"{label}: {summary['recomputed_steps']} steps or more"
        rows.append({"what": label, "seconds": round(v, 2), "share of wall": round(v / wall, 4)})
    return rows


def describe(summary: dict[str, Any]) -> str:
    """One line for people: the goodput, the wall time, the attempts, the biggest losses."""
    if not summary:
        return "no attempt recorded"
    losses = sorted(((v, k) for k, v in summary["lost_s"].items() if v >= 0.05), reverse=True)[:4]
    steps = summary.get("recomputed_steps")
    lost = ", ".join(
        f"{k} {v:.1f}s" + (f" ({steps} steps or more)" if k == "recomputed" and steps else "")
        for v, k in losses
    )
    return (
        f"{summary['goodput']:.1%} of {summary['wall_s']:.1f}s wall in kept training steps, "
        f"{summary['attempts']} attempt(s), {summary['interrupted']} interrupted"
        + (f"; lost: {lost}" if lost else "")
    )


def mlflow_metrics(summary: dict[str, Any], step: int) -> list[tuple[str, float, int]]:
    """The summary as MLflow metric rows: ``goodput/goodput``, ``goodput/wall_s``,
    ``goodput/lost_s/<cause>``..."""
    if not summary:
        return []
    values = {
        "goodput": summary["goodput"],
        "wall_s": summary["wall_s"],
        "productive_s": summary["productive_s"],
        "attempts": float(summary["attempts"]),
        "interrupted": float(summary["interrupted"]),
        **{f"lost_s/{cause}": float(v) for cause, v in summary["lost_s"].items()},
    }
    return [(GOODPUT_PREFIX + key, value, step) for key, value in values.items()]
