"""BENCHMARKS.md's sections on the way back after a preemption: the restart to the first new
step, a rerun on object storage (S3_RERUN.json) and reruns through a process worker."""

from __future__ import annotations

from report_common import fmt, read_record


def _restart_row(label: str, r: dict, last=None) -> str:
    "A row of the Restart tables: the parts of a rerun to its first new step, and the floor (or"
    "`last`)."
    tail = fmt(r["raw_restore_s"] + r["raw_step_s"], 3) if last is None else str(last)
    return (
        f"| {label} | {fmt(r['import_s'])} | {fmt(r['setup_s'])} | {fmt(r['restore_s'])} | "
        f"{fmt(r['first_step_s'], 3)} | {fmt(r['rerun_s'])} | {tail} |"
    )


def restart_markdown(report: dict) -> list[str]:
    """A rerun's way back to its first new step, by compilation cache, locally and on S3."""
    restart = report.get("restart") or {}
    if not restart:
        return []
    out = [
        "",
        "## Restart",
        "",
        "| compilation cache | imports s | setup s | restore s | first step s | setup + "
        "restore + step s | floor s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("no_cache", "cache_cold", "cache_warm"):
        r = restart.get(name)
        if r:
            out.append(_restart_row(name.replace("_", " "), r))
    out += [
        "",
        "A job resumed in fresh processes to its first new step: `setup` builds the "
        "trainer, `restore` takes the lease and restores, `first step` includes its "
        "compile or cache load. The floor: a bare Orbax restore plus one compiled step.",
    ]
    if restart.get("s3_cache_new_machine"):
        out += [
            "",
            "| job on S3, new machine | imports s | setup s | restore s | first step s | "
            "setup + restore + step s | entries copied in |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, label in (
            ("s3_no_cache", "no cache"),
            ("s3_cache_cold", "the job's cache, empty"),
            ("s3_cache_new_machine", "the job's cache, filled on another machine"),
        ):
            r = restart.get(name)
            if r:
                pulled = r.get("cache_pulled")
                out.append(_restart_row(label, r, last="—" if pulled is None else pulled))
        out += [
            "",
            f"On moto's S3 ({restart.get('s3_measured', 'this run')}), each rerun on a "
            f"new machine: `setup` starts copying the job's cache in, `restore` downloads "
            "the checkpoint while the step compiles. Where the download outlasts the "
            "compile, as for this small model, the cache cannot shorten the rerun.",
        ]
    return out


def s3_rerun_markdown() -> list[str]:
    """`benchmarks/s3_rerun.py`'s record (S3_RERUN.json; this run does not re-measure it)."""
    rec = read_record("S3_RERUN.json")
    if not rec:
        return []

    def parts(run: dict, side: str, key: str) -> list[float]:
        return [r[key] for r in run["reruns"][side]]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    text = []
    for run in rec["runs"]:
        where = f"loopback held to {run['rate']}" if run["rate"] else "loopback at full speed"
        sides = [s for s in ("new", "old") if run["reruns"].get(s)]
        said = [
            f"{'after' if s == 'new' else 'before'} {run['mean_to_first_step'][s]:.2f} s (restore "
            f"{mean(parts(run, s, 'restore')):.2f} s, start-up "
            f"{mean(parts(run, s, 'startup')):.2f} s)"
            for s in sides
        ]
        text.append(
            f"with {where}, killed {run['kill_at']:g} s after each start, "
            f"{len(run['reruns'][sides[0]])} reruns a side: " + ", ".join(said)
        )
    return [
        "",
        "A rerun's download begun before its flow run (`training/step_prefetch.py`; "
        f"`benchmarks/s3_rerun.py`, S3_RERUN.json, {rec['measured']}): the goodput job of the "
        "byte LM with its storage on moto's S3 on loopback, each rerun on a new machine (an "
        f"empty local stage, so its restore downloads the step: {rec['state']}), SIGTERM'd, "
        "the two checkouts alternating on one job. Process start to the end of the first new "
        "step (the ledger's start-up + restore + compile), means: "
        + "; ".join(text)
        + ". Held to a network's rate, the download moves out of the restore into the start-up, "
        "where it shares the two cores and the link with Prefect's start; at loopback speed "
        "(a download of about 0.3 s) the difference is within the noise. What it can save is "
        "bounded by the time from the head start to the restore task.",
    ]


def worker_rerun_markdown(wr: dict | None) -> list[str]:
    "`worker_rerun.py`: reruns of a deployment's flow run through a process worker and the rerun"
    "automation."
    if not wr or not wr.get("runs"):
        return []

    def spread(rows: list[dict], key: str) -> str:
        values = [r[key] for r in rows]
        if not values:
            return "—"
        return f"{sum(values) / len(values):.2f} ({min(values):.1f}-{max(values):.1f})"

    out = [
        "",
        "## Reruns through a process worker",
        "",
        "| worker poll s | run | kills | fresh reruns | kill to process | process to first "
        "new step | kill to first new step | reruns by a waiting process: kill to first new "
        "step | waits logged | errors in the worker's log |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in wr["runs"]:
        rows = r.get("reruns") or []
        fresh = [x for x in rows if not x.get("waited_for_another")]
        waited = [x for x in rows if x.get("waited_for_another")]
        out.append(
            f"| {r['query_seconds']:g} | {r['state']} | {r['kills']} | {len(fresh)} | "
            f"{spread(fresh, 'kill_to_process_s')} | "
            f"{spread(fresh, 'process_to_first_step_s')} | "
            f"{spread(fresh, 'kill_to_first_step_s')} | "
            f"{spread(waited, 'kill_to_first_step_s') if waited else '—'} | "
            f"{r['second_starts']} | {r['errors']} |"
        )
    return out + [
        "",
        f"`benchmarks/worker_rerun.py` ({wr.get('measured', 'this run')}): the "
        f"`train` flow on a `process` pool with the rerun automation, SIGKILLed 2 s "
        f"after each checkpoint. Mean (range), seconds. A waiting process is "
        "Prefect's second start of the same run (its worker reports one SIGKILL "
        "twice): it waits for the first, and takes over when that one is killed.",
    ]
