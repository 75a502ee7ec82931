"""Turns the results of `run.py` into the summary (ratios, targets) and BENCHMARKS.md.

This module holds the summary and the sections of `run.py`'s own sides (the systems, the interval
sweep, storage) and puts BENCHMARKS.md together (`write_markdown`); each other section is in the
module of its subject: `report_targets` (the targets table and what stands in each one's way),
`report_restart`, `report_goodput`, `report_scale` (GPU, several processes), `report_costs`
(per-interval costs, the floor), over the helpers of `report_common`. The sections of separate
benchmarks read their recorded JSON beside this file.
"""

from __future__ import annotations

import json

from report_common import fmt, get_in, median_of, ratio_of
from report_costs import (
    export_cost_markdown,
    floor_markdown,
    s3_requests_markdown,
    server_apart_markdown,
    server_cost_markdown,
    thread_cpu_markdown,
)
from report_goodput import goodput_lm_markdown, goodput_markdown, goodput_summary
from report_hand_notes import apply_hand_notes
from report_restart import restart_markdown, s3_rerun_markdown, worker_rerun_markdown
from report_scale import gpu_markdown, lm_gpu_markdown, multiprocess_markdown
from report_targets import targets_markdown

SYSTEMS = (
    ("plain", "hand-written JAX + optax + Orbax loop (the floor)"),
    ("plain_scan", "the same loop, {dispatch} steps per jitted `lax.scan`"),
    ("prefect_jax", "`train_and_evaluate`, standing `prefect server`"),
    ("prefect_jax_scan", "`train_and_evaluate`, standing server, `steps_per_dispatch={dispatch}`"),
    (
        "prefect_jax_ephemeral",
        "`train_and_evaluate`, ephemeral Prefect (server started inside the run)",
    ),
    ("cli", "the `prefect-jax run` command, standing server"),
    (
        "cli_exports",
        "the `prefect-jax run` command, standing server, its default exporters "
        "(latest, best, final; each export a version of an MLflow registered model)",
    ),
    (
        "cli_embedded",
        "the `prefect-jax run` command, no `PREFECT_API_URL` "
        "(its embedded server, as the README's `demo`)",
    ),
    ("keras", "Keras 3 `fit` + `BackupAndRestore`, JAX backend"),
    ("before", "`train_and_evaluate`, standing server, before this change (`--baseline`)"),
    (
        "before_cli_embedded",
        "the `prefect-jax run` command, embedded server, before this change (`--baseline`)",
    ),
)


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


def systems_markdown(report: dict, summary: dict) -> list[str]:
    """The headline sides: one row each, then what the clocks mean."""
    peers, dispatch = report["peers"], report["dispatch"]
    out = [
        "",
        "## Systems",
        "",
        "| system | process s | wall s | loop s | process / floor | wall / floor | loop / "
        "floor | peak RSS MiB | server CPU s | final eval accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, label in SYSTEMS:
        r = peers.get(name)
        if name not in peers:
            continue
        if r is None:
            out.append(f"| {label.format(dispatch=dispatch)} | failed | | | | | | | | |")
            continue
        ratio = summary["ratios"][name]
        acc = get_in(r, "eval", "accuracy")
        out.append(
            f"| {label.format(dispatch=dispatch)} | {fmt(r.get('process_s'))} | "
            f"{fmt(r.get('wall_s'))} | {fmt(r.get('loop_s'))} | {fmt(ratio.get('process'))} | "
            f"{fmt(ratio['wall'])} | {fmt(ratio['loop'])} | {fmt(r.get('peak_rss_mib'), 0)} | "
            f"{fmt(r.get('server_cpu_s'))} | {fmt(acc, 4)} |"
        )
    out += [
        "",
        f"The work: a 64-256-256-10 MLP on scikit-learn digits, batch 128, "
        f"{report['steps']} steps, an async checkpoint and a full evaluation every "
        f"{report['every']} steps, each side in a fresh process. `process`: the whole "
        "process, start to exit; `wall`: after the shared imports to the last checkpoint "
        "committed; `loop`: from the end of the first step (its compile excluded). "
        f"`server CPU`: the standing server's CPU time for the side, on the same two "
        f"cores (it started in {report['server_start_s']:.1f} s, before any clock).",
    ]
    before, after = peers.get("before"), peers.get("prefect_jax")
    if before and after:
        out += [
            "",
            "Before and after (this run; the flow side from the `--baseline` checkout):",
            "",
            "| | wall s | loop s | flow outside the engine s |",
            "|---|---:|---:|---:|",
            f"| before | {fmt(before['wall_s'])} | {fmt(before['loop_s'])} | "
            f"{fmt(before.get('prefect_s'))} |",
            f"| after | {fmt(after['wall_s'])} | {fmt(after['loop_s'])} | "
            f"{fmt(after.get('prefect_s'))} |",
        ]
    return out


def sweep_markdown(report: dict, summary: dict) -> list[str]:
    """The same steps split into more checkpoint intervals: the per-interval cost."""
    dispatch = report["dispatch"]
    one = next((row for row in report["intervals"] if row["intervals"] == 1), {})
    out = [
        "",
        "## Cost against the number of checkpoint intervals",
        "",
        "| intervals | every | plain loop s | flow loop s | extra s | extra ms / interval | "
        "flow: prefect s | flow: mlflow s | plain: CPU s | flow: CPU s | server CPU s, plain "
        "/ flow |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["intervals"]:
        p, f = row.get("plain") or {}, row.get("prefect_jax") or {}
        extra = f.get("loop_s") - p.get("loop_s") if f.get("loop_s") and p.get("loop_s") else None
        out.append(
            f"| {row['intervals']} | {row['every']} | {fmt(p.get('loop_s'))} | "
            f"{fmt(f.get('loop_s'))} | {fmt(extra)} | "
            f"{fmt(extra and extra * 1000 / row['intervals'], 1)} | "
            f"{fmt(f.get('prefect_s'))} | {fmt(f.get('mlflow_s'))} | {fmt(p.get('cpu_s'))} | "
            f"{fmt(f.get('cpu_s'))} | {fmt(p.get('server_cpu_s'))} / "
            f"{fmt(f.get('server_cpu_s'))} |"
        )
    out += [
        "",
        f"The same {report['steps']} steps in more intervals (each a checkpoint and a "
        f"full eval). `extra`: the flow's loop time minus the plain loop's, whose slope "
        "is the per-interval cost; `prefect`: the flow's time outside the engine; "
        "`mlflow`: its thread's time in MLflow calls; `CPU`: each side's whole process."
        + (
            " Cells are medians over the rounds."
            if len(report.get("interval_rounds") or []) > 1
            else ""
        ),
    ]
    cpu = summary.get("cpu_ms_per_interval")
    if cpu:
        each = {k: ", ".join(fmt(x, 1) for x in v) for k, v in cpu["per_round"].items()}
        out += [
            "",
            f"CPU per interval over the plain loop (median of per-round slopes): the "
            f"flow's process {fmt(cpu['process'], 1)} ms (per round {each['process']}), "
            f"the standing server {fmt(cpu['server'], 1)} ms ({each['server']}), on the "
            f"same two cores.",
        ]
    if one.get("plain_scan") and one.get("prefect_jax_scan"):
        line = (
            f"One interval, `{dispatch}` steps per dispatch: loop time plain scan loop "
            f"{fmt(get_in(one, 'plain_scan', 'loop_s'))} s, flow "
            f"{fmt(get_in(one, 'prefect_jax_scan', 'loop_s'))} s"
        )
        if get_in(one, "prefect_jax_scan", "train_s"):
            line += (
                f"; the steps alone (first step's end to last step's end) plain scan "
                f"{fmt(get_in(one, 'plain_scan', 'train_s'))} s, flow "
                f"{fmt(get_in(one, 'prefect_jax_scan', 'train_s'))} s, plain per-step "
                f"{fmt(get_in(one, 'plain', 'train_s'))} s, flow per-step "
                f"{fmt(get_in(one, 'prefect_jax', 'train_s'))} s"
            )
        out += ["", line + "."]
    return out + server_cost_markdown(report.get("server_cost"))


def storage_markdown(report: dict) -> list[str]:
    rows = get_in(report, "storage", "rows")
    if not rows:
        return []
    out = [
        "",
        "## Checkpoint cost against state size (local disk)",
        "",
        "| state MiB | save s | sync save s | stall s | stall % of sync | restore s | raw "
        "write s | raw read s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['mib']} | {fmt(r['save_s'], 3)} | {fmt(r['sync_save_s'], 3)} | "
            f"{fmt(r['stall_s'], 3)} | {fmt(r['stall_pct'], 1)} | {fmt(r['restore_s'], 3)} | "
            f"{fmt(r['raw_write_s'], 3)} | {fmt(r['raw_read_s'], 3)} |"
        )
    return out + [
        "",
        "`stall`: how long `save` blocks the training loop; `sync save`: a save "
        "waited for to the end; `raw`: the same bytes written and read without "
        "Orbax.",
    ]


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
