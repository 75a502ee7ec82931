"""The sections of BENCHMARKS.md on `run.py`'s own sides: the systems compared on the digits
job (`SYSTEMS`, one row each), the cost against the number of checkpoint intervals, and the
checkpoint cost against the state's size. `report.write_markdown` puts them in the page."""

from __future__ import annotations

from report_common import fmt, get_in
from report_costs import server_cost_markdown

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
