"""BENCHMARKS.md's targets table, and what stands in the way of each missed target."""

from __future__ import annotations

from report_common import fmt, get_in
from report_costs import floor_lead

# What a missed target means and what stands in its way, printed under the targets table (a few
# lines each: the numbers live in the tables, so this text does not go stale with each run).
GAPS = {
    "process_vs_plain": (
        "Besides the plain loop's work, a `prefect-jax run` process imports Prefect and makes a "
        "flow run and two task runs per interval. On a job of a few seconds of training these "
        "fixed costs are most of the ratio; they do not grow with the job."
    ),
    "loop_vs_plain": (
        "The target leaves about a tenth of the plain loop's loop time for all of the flow's "
        "checkpoint intervals, and each interval has a fixed cost (next line): Prefect's two "
        "task runs alone already go over it on these two shared cores. With checkpoints minutes "
        "apart, as on a GPU job, that cost is a negligible share of an interval."
    ),
    "orchestration_ms_per_interval": (
        "Per interval: two Prefect task runs, a three-item Orbax save (state, data position, "
        "metadata) and the eval record. The standing Prefect server, on the training's two "
        "cores, uses about as much CPU as the flow's own process: see [CPU by "
        "thread](#cpu-per-checkpoint-interval-by-thread) and [the server on cores of its "
        "own](#with-the-prefect-server-on-cores-of-its-own)."
    ),
    "prefect_ms_per_interval": (
        "Two task runs per interval, most of it Prefect's task engine in this process (state "
        "changes, result records), with the server process sharing the two cores."
    ),
    "steps_per_dispatch_speedup": (
        "One interval of about a second: the ratio moves with the plain per-step loop's own "
        "speed from round to round (the per-round column), not with the flow's scan. On a GPU, "
        "where dispatch is the cost it removes, the scan runs about twice the plain per-step "
        "loop's steps per second ([On a GPU](#on-a-gpu))."
    ),
    "stall_pct_of_sync_save_512mib": "",
    "rerun_to_first_step_vs_plain": (
        "A rerun's way back is mostly start-up: Prefect's import, the flows module, the flow run "
        "and the restore task with their API round trips, besides the imports the plain loop "
        "pays too. A flow run must exist before training (it is what shows a killed attempt as "
        "Crashed and reruns it), so Prefect's import keeps this ratio well above 1 on these "
        "cores."
    ),
    "goodput_margin_vs_peers": (
        "On SIGTERM prefect-jax loses no step (the step in flight is committed); on SIGKILL "
        "every system loses the steps since its last checkpoint, and prefect-jax also pays its "
        "longer start-up per attempt (its backups keep recomputed steps near zero). One run of "
        "each on shared cores: read differences under ~0.1 as noise."
    ),
    "goodput_T60_SIGTERM": (
        "A job of about two 60 s attempts moves in steps of a whole attempt; the ledger's own "
        "goodput (kept training time / wall, inside one job) needs no separate uninterrupted run "
        "and is the steadier figure."
    ),
}


TARGET_NAMES = {
    "process_vs_plain": "whole process, `prefect-jax run` on a standing server / plain loop",
    "loop_vs_plain": "loop time, flow on a standing server / plain loop",
    "orchestration_ms_per_interval": (
        "extra loop time per checkpoint interval over the plain loop, ms"
    ),
    "prefect_ms_per_interval": "of which Prefect (task runs, state changes, artifacts), ms",
    "steps_per_dispatch_speedup": (
        "training speed: plain per-step loop / flow with `steps_per_dispatch={dispatch}`, "
        "one interval"
    ),
    "stall_pct_of_sync_save_512mib": (
        "training stall per checkpoint, % of a synchronous save, 512 MiB state"
    ),
    "rerun_to_first_step_vs_plain": (
        "rerun after a preemption to its first new step: `prefect-jax run` / plain loop"
    ),
    "goodput_margin_vs_peers": (
        "goodput under preemption: prefect-jax minus the best peer, worst period and signal"
    ),
    "goodput_T60_SIGTERM": "goodput of prefect-jax, SIGTERM every 60 s",
}


def targets_markdown(report: dict, summary: dict) -> list[str]:
    """The targets table, then a short note for each one missed."""
    names = {k: v.format(dispatch=report["dispatch"]) for k, v in TARGET_NAMES.items()}
    out = [
        "",
        "## Targets",
        "",
        "| target | measured | goal | met | per round |",
        "|---|---:|---:|:---:|---|",
    ]
    for key, t in summary["targets"].items():
        each = ", ".join(fmt(v) for v in t.get("per_round") or [])
        out.append(
            f"| {names[key]} | {fmt(t['value'])} | {t['target']} | "
            f"{'yes' if t['met'] else '**no**'} | {each} |"
        )
    out += [
        "",
        "Ratios and slopes compare sides measured in the same run; the per-interval "
        "slopes come from the [sweep](#cost-against-the-number-of-checkpoint-intervals), "
        "the rerun and goodput targets from the [goodput "
        "runs](#goodput-under-preemption).",
    ]
    if get_in(report, "goodput", "note"):
        out += [
            "The three goodput targets are read from goodput rows that are not from this "
            "run: see the note there."
        ]
    missed = [key for key, t in summary["targets"].items() if not t["met"] and GAPS.get(key)]
    if missed:
        out += ["", "What stands in the way:", ""]
        out += [f"- **{names[key]}**: {floor_lead(key)}{GAPS[key]}" for key in missed]
    return out
