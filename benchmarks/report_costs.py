"""BENCHMARKS.md's sections on what a checkpoint interval costs and where: the Prefect server's
share, object-storage requests, exports, CPU by thread, the floor under the targets, the server
on cores of its own."""

from __future__ import annotations

import statistics

from report_common import fmt, read_record

SERVER_COST_KINDS = (
    ("two_task_runs", "two task runs (train, evaluate)"),
    ("two_events", "two events (checkpoint committed, eval completed)"),
    ("table_artifact", "a table artifact (the results)"),
    ("progress_update", "a progress artifact update"),
)


def server_cost_markdown(sc: dict | None) -> list[str]:
    """`server_cost.py`: the Prefect server's CPU per kind of call that an interval makes."""
    if not sc:
        return []
    out = ["", "| per iteration | server CPU ms | the flow's CPU ms |", "|---|---:|---:|"]
    rows = [sc.get(key) or {} for key, _ in SERVER_COST_KINDS]
    for row, (_, label) in zip(rows, SERVER_COST_KINDS, strict=True):
        out.append(
            f"| {label} | {fmt(row.get('server_cpu_ms'), 1)} | {fmt(row.get('flow_cpu_ms'), 1)} |"
        )

    def total(key):  # None (shown as a dash) where a kind is missing
        values = [row.get(key) for row in rows]
        return None if None in values else sum(values)

    out.append(f"| all four | {fmt(total('server_cpu_ms'), 1)} | {fmt(total('flow_cpu_ms'), 1)} |")
    return out + [
        "",
        f"What one interval's Prefect calls cost the standing server "
        f"(`benchmarks/server_cost.py`, {sc.get('measured', 'this run')}: "
        f"{sc['iterations']} iterations of each kind alone, less an empty flow's). "
        "The results table and the progress update are made at most every "
        "`PREFECT_JAX_UI_REFRESH_SECS` (2 s), the task runs and events at every "
        "interval.",
    ]


def s3_requests_markdown() -> list[str]:
    """`benchmarks/s3_requests.py`'s record (S3_REQUESTS.json; this run does not re-measure it)."""
    r = read_record("S3_REQUESTS.json")
    if r is None:
        return []
    p, rr = r["per_interval"], r["rerun_restore"]
    by = p["requests_by_operation"]
    ops = ", ".join(
        f"{op} {by[op]:g}"
        for op in (
            "GetObject",
            "HeadObject",
            "ListObjectsV2",
            "PutObject",
            "DeleteObject",
            "DeleteObjects",
        )
        if op in by
    )
    return [
        "",
        "## Object storage: requests per checkpoint interval",
        "",
        "| training-thread calls / interval | their wait, ms | S3 requests / interval | by "
        "operation | rerun's restore: calls, wait s |",
        "|---:|---:|---:|---|---:|",
        f"| {p['training_thread_calls']:g} | {p['training_thread_wait_ms']:.0f} | "
        f"{p['requests']:g} | {ops} | "
        f"{rr['calls_total']}, {rr['wait_s']:.2f} |",
        "",
        f"`benchmarks/s3_requests.py` ({r['when']}, code {r.get('code', '?')}; not "
        f"re-measured by this run): the flow on moto's S3 server on loopback, a checkpoint "
        f"and an evaluation every {r['every']} steps. The training thread's calls are the "
        "round trips each interval waits for; the requests include the background uploads. "
        "The rerun restores on a new machine (an empty local stage).",
    ]


def export_cost_markdown() -> list[str]:
    """`benchmarks/export_cost.py`'s record (EXPORT_COST.json; this run does not re-measure it)."""
    r = read_record("EXPORT_COST.json")
    if r is None:
        return []
    m = r.get("machine") or {}
    out = [
        "",
        "## Export cost per checkpoint interval (`export_cost.py`)",
        "",
        "| exports | export, first interval s | export, then median s | train, median s | "
        "train + export, median s |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        both = row.get("interval_secs_median")
        out.append(
            f"| {row['mode']} | {row['first']:.3f} | {row['median_after_first']:.3f} | "
            f"{row['train_secs_per_interval_median']:.3f} | "
            f"{'—' if both is None else f'{both:.3f}'} |"
        )
    return out + [
        "",
        f"`benchmarks/export_cost.py` ({r['when']}, {m.get('cpus', '?')} CPUs, JAX "
        f"{m.get('jax', '?')} on {m.get('devices', '?')}; not re-measured by this run): the digits "
        f"program with three exporters (latest, best, final), {r['intervals']} intervals of "
        f"{r['every']} steps; the training thread's time in the export per interval (with, in "
        "the background, its wait for the previous export; its wait at the next save is in the "
        "train time). One lowering per step serves the three exporters; the platforms are the "
        "job's and cpu unless named (all four before); the lowering and writing overlap the next "
        "interval's training. On 2 shared CPUs the background thread competes with training for "
        "them: compare train + export.",
    ]


ORBAX_THREADS = (
    "array_type_handler",
    "serialize_shardings",
    "async_save",
    "asyncio",
    "save_finalize",
    "write_metadata_after_commits",
    "metadata_store",
    "_target_setting_result",
    "json_ch_save",
    "prefect_jax_data_save",
)


PREFECT_THREADS = ("GlobalEventLoopThread", "EventsWorkerThread")


def thread_cpu_markdown() -> list[str]:
    """`benchmarks/thread_cpu.py`'s record (THREAD_CPU.json; this run does not re-measure it)."""
    r = read_record("THREAD_CPU.json")
    if r is None or r.get("sides", ["plain", "prefect_jax"]) != ["plain", "prefect_jax"]:
        return []
    per = r.get("per_interval_ms") or {}
    plain, flow = per.get("plain", {}), per.get("prefect_jax", {})
    if not flow:
        return []
    few, many = r["intervals"]
    m = r.get("machine") or {}
    order = sorted(set(plain) | set(flow), key=lambda k: -max(flow.get(k, 0.0), plain.get(k, 0.0)))
    order = [k for k in order if k not in ("loop time", "the process, in all")]
    shown = [k for k in order if max(abs(flow.get(k, 0.0)), abs(plain.get(k, 0.0))) >= 0.5]
    rest = [k for k in order if k not in shown]

    def cell(side: dict, k: str) -> str:
        return f"{side[k]:.1f}" if k in side else "—"

    out = [
        "",
        "## CPU per checkpoint interval, by thread",
        "",
        "| | plain loop | flow |",
        "|---|---:|---:|",
    ]
    for k in ["loop time", "the process, in all"] + shown:
        out.append(
            f"| {'loop time (wall, not CPU)' if k == 'loop time' else k} | "
            f"{cell(plain, k)} | {cell(flow, k)} |"
        )
    if rest:
        out.append(
            f"| other threads ({len(rest)} kinds, under 0.5 ms each) | "
            f"{sum(plain.get(k, 0.0) for k in rest):.1f} | "
            f"{sum(flow.get(k, 0.0) for k in rest):.1f} |"
        )
    extra = lambda k: flow.get(k, 0.0) - plain.get(k, 0.0)  # noqa: E731
    orbax = sum(extra(k) for k in order if any(t in k for t in ORBAX_THREADS))
    prefect = sum(extra(k) for k in order if any(t in k for t in PREFECT_THREADS))
    out += [
        "",
        f"`benchmarks/thread_cpu.py` ({r['when']}, {m.get('cpu', '?')}, "
        f"{m.get('cpus', '?')} CPUs; not re-measured by this run): CPU ms per interval "
        f"(the slope between {few} and {many} intervals, median of {len(r['rounds'])} "
        "rounds) of each kind of thread, the MLflow worker and the Prefect server. Over "
        f"the plain loop, the flow's process used {extra('the process, in all'):.1f} ms: "
        f"its main thread {extra('thread MainThread'):.1f}, Orbax's threads {orbax:.1f} "
        f"(a three-item save), Prefect's event client {prefect:.1f}; besides, its MLflow "
        f"worker {extra('child processes (the MLflow worker)'):.1f} and the server "
        f"{extra('the Prefect server'):.1f}.",
    ]
    return out


def _floor() -> dict | None:
    "`benchmarks/floor.py`'s record (FLOOR.json), with its per-interval and rerun parts, or None."
    r = read_record("FLOOR.json")
    return r if r and (r.get("per_interval_ms") or r.get("rerun")) else None


def floor_lead(key: str) -> str:
    "A target's floor from FLOOR.json, put first in its note ( if none): what Prefect alone"
    "costs there."
    r = _floor()
    if r is None:
        return ""
    per, rerun = r.get("per_interval_ms") or {}, r.get("rerun") or {}
    plain, tasks, flow = per.get("plain"), per.get("plain_tasks"), per.get("prefect_jax")
    few = r["intervals"][0]
    where = "[the floor](#the-floor-under-the-targets)"
    # Each side's slopes, the median over rounds.
    if key == "orchestration_ms_per_interval" and plain and tasks and flow:
        return (
            f"In {where}, Prefect's two task runs alone add "
            f"{tasks['loop_s'] - plain['loop_s']:.1f} ms per interval to the plain loop; the "
            f"flow adds {flow['loop_s'] - tasks['loop_s']:.1f} ms more. "
        )
    ratio = f"loop / plain loop at {few} intervals"
    if key == "loop_vs_plain" and tasks and flow and tasks.get(ratio):
        return (
            f"In {where}, the plain loop with its intervals in two Prefect task runs reads "
            f"{tasks[ratio]:.2f}, the flow {flow[ratio]:.2f}. "
        )
    ratios = rerun.get("median / plain loop") or {}
    if key == "rerun_to_first_step_vs_plain" and ratios.get("plain_prefect"):
        return (
            f"In {where}, the plain loop that only imports Prefect first comes back in "
            f"{ratios['plain_prefect']:.2f} of its time, as a flow run of task runs in "
            f"{ratios.get('plain_flow', float('nan')):.2f}, `prefect-jax run` in "
            f"{ratios.get('prefect_jax', float('nan')):.2f}. "
        )
    return ""


def floor_markdown() -> list[str]:
    """`benchmarks/floor.py`'s record (FLOOR.json; this run does not re-measure it)."""
    r = _floor()
    if r is None:
        return []
    m = r.get("machine") or {}
    out = ["", "## The floor under the targets"]
    per = r.get("per_interval_ms") or {}
    if per:
        few, many = r["intervals"]
        ratio = f"loop / plain loop at {few} intervals"
        labels = {
            "plain": "the plain loop",
            "plain_tasks": "the plain loop, each interval in two Prefect task runs "
            "(the steps and the save; the evaluation) in a flow run",
            "prefect_jax": "the `train_and_evaluate` flow",
        }
        out += [
            "",
            f"| side | loop time / interval | over the plain loop | its process's CPU / "
            f"interval | server CPU / interval | "
            f"loop time / plain loop's, {few} intervals |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, label in labels.items():
            p = per.get(name)
            if p and per.get("plain"):
                out.append(
                    f"| {label} | {p['loop_s']:.1f} | "
                    f"{p['loop_s'] - per['plain']['loop_s']:.1f} | {p['cpu_s']:.1f} | "
                    f"{p['server_cpu_s']:.1f} | {fmt(p.get(ratio))} |"
                )
        out += [
            "",
            f"Per checkpoint interval, ms: {r['steps']} steps at {few} and {many} "
            f"intervals on one standing `prefect server`, the slope between the two, the "
            f"median of {len(r['rounds'])} rounds.",
        ]
    rerun = r.get("rerun")
    if rerun:
        labels = {
            "plain": "the plain loop (`goodput.py`'s)",
            "plain_prefect": "the plain loop, importing Prefect first "
            "(with the collector off for that import only)",
            "plain_flow": "the plain loop as a Prefect flow run: the restore, each "
            "interval's steps and save, and its evaluation in task runs",
            "prefect_jax": "`prefect-jax run`",
        }
        out += ["", "| side | median s | / plain loop | each rerun, s |", "|---|---:|---:|---|"]
        for name, label in labels.items():
            if rerun["way_back_s"].get(name):
                out.append(
                    f"| {label} | {rerun['median_s'][name]:.2f} | "
                    f"{fmt((rerun.get('median / plain loop') or {}).get(name))} | "
                    f"{', '.join(f'{v:.2f}' for v in rerun['way_back_s'][name])} |"
                )
        out += [
            "",
            f"A rerun's way back, from its process start to its first new step: "
            f"`bench_programs:wide` trained to step {rerun['every']}, then "
            f"{rerun['reruns']} alternated reruns of each (compilation cache warm).",
        ]
    return out + [
        "",
        f"`benchmarks/floor.py` ({r['when']}, {m.get('cpu', '?')}, "
        f"{m.get('cpus', '?')} CPUs; not re-measured by this run): the plain loop "
        "itself run under Prefect, with nothing of prefect-jax, where the targets "
        "compare prefect-jax with the plain loop.",
    ]


def server_apart_markdown() -> list[str]:
    """`benchmarks/server_apart.py`'s record (SERVER_APART.json, measured on a machine with more
    than two CPUs; this run does not re-measure it)."""

    a = read_record("SERVER_APART.json")
    if a is None:
        return []
    few, many = a["intervals"][0], a["intervals"][-1]

    def slopes(where: str, side: str, key: str) -> list[float]:
        out = []
        for r in sorted({row["round"] for row in a["rows"]}):
            got = {
                row["intervals"]: row
                for row in a["rows"]
                if (row["round"], row["where"], row["side"]) == (r, where, side)
            }
            if key in got.get(few, {}) and key in got.get(many, {}):
                out.append(1000 * (got[many][key] - got[few][key]) / (many - few))
        return out

    def spread(values: list[float]) -> str:
        if not values:
            return "—"
        return f"{statistics.median(values):.1f} ({', '.join(f'{v:.1f}' for v in values)})"

    out = [
        "",
        "## With the Prefect server on cores of its own",
        "",
        f"| server | flow extra loop time per interval over the plain loop | flow / plain loop "
        f"time at {few} intervals | flow loop time per interval | plain loop time per interval "
        "| flow's own CPU per interval | plain's CPU per interval | server CPU per interval |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for where in ("apart", "shared"):
        s = a["summary"].get(where)
        if not s:
            continue
        ratio = s[f"loop_over_plain_at_{few}"]
        out.append(
            f"| {where} | {spread(s['per_round_ms'])} | {ratio:.2f} "
            f"({', '.join(f'{v:.2f}' for v in s['per_round_ratio'])}) | "
            f"{spread(slopes(where, 'prefect_jax', 'loop_s'))} | "
            f"{spread(slopes(where, 'plain', 'loop_s'))} | "
            f"{spread(slopes(where, 'prefect_jax', 'cpu_s'))} | "
            f"{spread(slopes(where, 'plain', 'cpu_s'))} | "
            f"{spread(slopes(where, 'prefect_jax', 'server_cpu_s'))} |"
        )
    return out + [
        "",
        f"`benchmarks/server_apart.py` ({a['when']}, {a['device']}; not re-measured "
        f"by this run): the training on CPUs {a['train_cores']}, the standing "
        f"server pinned to CPUs {a['server_cores']} (apart) or to the training's "
        f"(shared, as on the 2-CPU machines); {few} and {many} intervals, ms per "
        f"interval: median (per round). The plain loop deletes old steps on one "
        "thread, as the engine does.",
    ]
