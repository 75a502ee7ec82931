"""Turns the results of `run.py` into the summary (ratios, targets) and BENCHMARKS.md.

This module holds the summary and puts BENCHMARKS.md together (`write_markdown`); each section is
in the module of its subject: `report_sides` (`run.py`'s own sides: the systems, the interval
sweep, storage), `report_targets` (the targets table and what stands in each one's way),
`report_restart`, `report_goodput`, `report_scale` (GPU, several processes), `report_costs`
(per-interval costs, the floor), over the helpers of `report_common`. The sections of separate
benchmarks read their recorded JSON beside this file.
"""

from __future__ import annotations

import json

from report_common import get_in, median_of, ratio_of
from report_costs import (
    export_cost_markdown,
    floor_markdown,
    s3_requests_markdown,
    server_apart_markdown,
    thread_cpu_markdown,
)
from report_goodput import goodput_lm_markdown, goodput_markdown, goodput_summary
from report_hand_notes import apply_hand_notes
from report_restart import restart_markdown, s3_rerun_markdown, worker_rerun_markdown
from report_scale import gpu_markdown, lm_gpu_markdown, multiprocess_markdown
from report_sides import SYSTEMS, storage_markdown, sweep_markdown, systems_markdown
from report_targets import targets_markdown


def _slope(points):
    """Least-squares slope of (x, y) points."""
    points = [(x, y) for x, y in points if y is not None]
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else None


def _per_round_ratios(rounds: list[dict], name: str, key: str) -> list[float | None]:
    """`name`'s `key` over the plain loop's, round by round (None: a round where either failed)."""
    return [ratio_of(get_in(rnd, name, key), get_in(rnd, "plain", key)) for rnd in rounds]


def _extra_slope(sweep: list[dict], key: str) -> float | None:
    """One sweep's slope over the intervals of the flow's `key` less the plain loop's (rows where
    either lacks it are left out: a failed side, or a run from before `key` was recorded)."""
    return _slope(
        [
            (row["intervals"], get_in(row, "prefect_jax", key) - get_in(row, "plain", key))
            for row in sweep
            if get_in(row, "prefect_jax", key) is not None and get_in(row, "plain", key) is not None
        ]
    )


def _sweep_slopes(sweep: list[dict]) -> tuple[float | None, float | None]:
    """One sweep's slopes: the flow's extra loop time over plain's, and
    its Prefect time, per interval."""
    return _extra_slope(sweep, "loop_s"), _slope(
        [(row["intervals"], get_in(row, "prefect_jax", "prefect_s")) for row in sweep]
    )


def _cpu_slopes(sweep: list[dict]) -> tuple[float | None, float | None]:
    """One sweep's CPU seconds per interval: the flow's process over the plain loop's, and the
    standing server's while the flow ran over its while the plain loop ran (runs before 2026-11-27
    did not record them: None)."""
    return _extra_slope(sweep, "cpu_s"), _extra_slope(sweep, "server_cpu_s")


def summarize(report: dict) -> dict:
    """Ratios and targets. With interleaved rounds (`report["rounds"]`,
    `report["interval_rounds"]`), a ratio or a slope is the median of its per-round
    values (kept under ``per_round``); the sides run once (ephemeral, embedded) are read
    against the plain loop's median."""
    peers = report["peers"]
    rounds = report.get("rounds") or [peers]
    sweeps = report.get("interval_rounds") or [report["intervals"]]
    per_round: dict = {}

    def ratio(name, key):
        if any(rnd.get(name) for rnd in rounds):
            values = _per_round_ratios(rounds, name, key)
            per_round.setdefault(name, {})[key] = values
            middle = median_of(values)
            return round(middle, 3) if middle is not None else None
        return ratio_of(get_in(peers, name, key), get_in(peers, "plain", key))

    ratios = {
        name: {
            "loop": ratio(name, "loop_s"),
            "wall": ratio(name, "wall_s"),
            "process": ratio(name, "process_s"),
        }
        for name, _ in SYSTEMS
        if peers.get(name)
    }
    slopes = [_sweep_slopes(sw) for sw in sweeps]
    per_interval = median_of([s[0] for s in slopes])
    prefect_per_interval = median_of([s[1] for s in slopes])
    ones = [next((row for row in sw if row["intervals"] == 1), {}) for sw in sweeps]
    # Training speed: the steps alone (`train_s`); reports from before it was recorded: the loop.
    speed_key = (
        "train_s" if any(get_in(o, "prefect_jax_scan", "train_s") for o in ones) else "loop_s"
    )
    scan_speedups = [
        ratio_of(get_in(o, "plain", speed_key), get_in(o, "prefect_jax_scan", speed_key))
        for o in ones
    ]
    restart = report.get("restart") or {}
    warm = restart.get("cache_warm") or {}
    floor = (warm.get("raw_restore_s") or 0) + (warm.get("raw_step_s") or 0)
    rerun = warm.get("rerun_s")
    stall = next((r for r in (get_in(report, "storage", "rows") or []) if r["mib"] == 512), None)
    scan_speedup = median_of(scan_speedups)
    scan_speedup = round(scan_speedup, 3) if scan_speedup is not None else None
    gp = goodput_summary(report.get("goodput"))
    targets = {
        "process_vs_plain": {"value": ratios.get("cli", {}).get("process"), "target": "<= 1.30"},
        "loop_vs_plain": {"value": ratios.get("prefect_jax", {}).get("loop"), "target": "<= 1.10"},
        "orchestration_ms_per_interval": {
            "value": round(per_interval * 1000, 1) if per_interval is not None else None,
            "target": "<= 30",
        },
        "prefect_ms_per_interval": {
            "value": round(prefect_per_interval * 1000, 1)
            if prefect_per_interval is not None
            else None,
            "target": "<= 30",
        },
        "steps_per_dispatch_speedup": {
            "value": scan_speedup,
            "target": ">= 1.2",
            "clock": speed_key,
        },
        "stall_pct_of_sync_save_512mib": {
            "value": stall and round(stall["stall_pct"], 2),
            "target": "<= 5",
        },
        "rerun_to_first_step_vs_plain": {"value": gp.get("restart_vs_plain"), "target": "<= 1.30"},
        "goodput_margin_vs_peers": {"value": gp.get("worst_margin"), "target": ">= 0"},
        "goodput_T60_SIGTERM": {"value": gp.get("t60_term"), "target": ">= 0.90"},
    }
    checks = {
        "process_vs_plain": lambda v: v <= 1.30,
        "loop_vs_plain": lambda v: v <= 1.10,
        "orchestration_ms_per_interval": lambda v: v <= 30,
        "prefect_ms_per_interval": lambda v: v <= 30,
        "steps_per_dispatch_speedup": lambda v: v >= 1.2,
        "stall_pct_of_sync_save_512mib": lambda v: v <= 5,
        "rerun_to_first_step_vs_plain": lambda v: v <= 1.30,
        "goodput_margin_vs_peers": lambda v: v >= 0,
        "goodput_T60_SIGTERM": lambda v: v >= 0.90,
    }
    for key, t in targets.items():
        t["met"] = t["value"] is not None and checks[key](t["value"])
    ms = lambda xs: [round(x * 1000, 1) if x is not None else None for x in xs]  # noqa: E731
    round_values = {
        "process_vs_plain": get_in(per_round, "cli", "process_s"),
        "loop_vs_plain": get_in(per_round, "prefect_jax", "loop_s"),
        "orchestration_ms_per_interval": ms([s[0] for s in slopes]),
        "prefect_ms_per_interval": ms([s[1] for s in slopes]),
        "steps_per_dispatch_speedup": scan_speedups,
    }
    for key, values in round_values.items():
        if values and len(values) > 1:
            targets[key]["per_round"] = values
    return {
        "benchmark": "prefect-jax",
        "when": report["when"],
        "steps": report["steps"],
        "every": report["every"],
        "ratios": ratios,
        "targets": targets,
        "machine": report["machine"],
        "rerun_to_first_step_vs_floor": ratio_of(rerun, floor),
        "peak_rss_mib": {
            name: round(peers[name]["peak_rss_mib"])
            for name, _ in SYSTEMS
            if get_in(peers, name, "peak_rss_mib")
        },
        "cpu_ms_per_interval": cpu_per_interval(sweeps),
        "goodput": gp.get("table"),
    }


def cpu_per_interval(sweeps: list[list[dict]]) -> dict | None:
    """The extra CPU time of each checkpoint interval, ms (medians of per-round slopes): in the
    flow's process (over the plain loop's) and in the standing server, on the same cores."""
    slopes = [_cpu_slopes(sw) for sw in sweeps]
    process, server = median_of([s[0] for s in slopes]), median_of([s[1] for s in slopes])
    if process is None and server is None:
        return None
    ms = lambda x: round(x * 1000, 1) if x is not None else None  # noqa: E731
    return {
        "process": ms(process),
        "server": ms(server),
        "per_round": {"process": [ms(s[0]) for s in slopes], "server": [ms(s[1]) for s in slopes]},
    }


def _rounds_line(report: dict) -> str:
    n = len(report.get("rounds") or [])
    if n <= 1:
        return "One run of each side."
    return (
        f"The headline sides and the interval sweep ran in {n} interleaved rounds: seconds "
        f"are medians, a ratio or a slope the median of its per-round values; the other sides "
        "ran once."
    )


def write_markdown(report: dict, summary: dict, hand_notes: bool = True) -> str:
    m = report["machine"]
    out = [
        "# Benchmarks",
        "",
        f"Written by `uv run --group bench python benchmarks/run.py` on {report['when']} "
        f"({report['total_s'] / 60:.0f} min), {m['cpu']}, {m['cpus']} CPUs, {m['memory_gib']} "
        f"GiB; Python {m['python']}; JAX {m['jax']} on {m['devices']}. {_rounds_line(report)} "
        f"These machines are shared and noisy: read the ratios, not the seconds. How each side is "
        "measured: [benchmarks/README.md](benchmarks/README.md).",
    ]
    out += targets_markdown(report, summary)
    out += systems_markdown(report, summary)
    out += sweep_markdown(report, summary)
    out += restart_markdown(report)
    out += s3_rerun_markdown()
    out += worker_rerun_markdown(report.get("worker_rerun"))
    out += goodput_markdown(report.get("goodput"), summary)
    out += goodput_lm_markdown()
    out += multiprocess_markdown(report.get("multiprocess"))
    out += gpu_markdown()
    out += lm_gpu_markdown()
    out += server_apart_markdown()
    out += s3_requests_markdown()
    out += thread_cpu_markdown()
    out += export_cost_markdown()
    out += floor_markdown()
    out += storage_markdown(report)
    out += ["", "## JSON", "", "```json", json.dumps(summary), "```", ""]
    page = "\n".join(out)
    return apply_hand_notes(page) if hand_notes else page
