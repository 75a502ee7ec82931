"""BENCHMARKS.md's sections of the records made on a lent GPU machine (GPU-*.json, LM-GPU-*.json)
and across several processes (the ``multiprocess`` entry of BENCHMARKS.json, which `run.py` runs;
`multiprocess.py` alone writes the same as MULTIPROCESS.json)."""

from __future__ import annotations

import json
import statistics

from report_common import fmt


def gpu_markdown() -> list[str]:
    """The GPU figures recorded by `benchmarks/gpu.py` and `benchmarks/gpu_check.sh` on a lent GPU
    machine (this machine has none)."""
    import glob
    import os

    out, notes = [], []
    here = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(here, "GPU-*.json"))):
        with open(path) as f:
            g = json.load(f)
        sp, er = g["speed"], g["exact_resume"]
        if not out:
            out += [
                "",
                "## On a GPU",
                "",
                "| device | recorded | MLP width, batch | steps, every | plain steps/s | "
                "engine steps/s | engine / plain time | engine `steps_per_dispatch=10` "
                "steps/s | / plain time | exact resume (fingerprints) |",
                "|---|---|---|---|---:|---:|---:|---:|---:|---|",
            ]
        out.append(
            f"| {g['device_kind']} | {g['recorded']} | {g['width']}, {g['batch']} | "
            f"{g['steps']}, {g['every']} | {sp['plain_steps_per_s']:.0f} | "
            f"{sp['engine_steps_per_s']:.0f} | {sp['engine_vs_plain_time']:.3f} | "
            f"{sp['engine_scan10_steps_per_s']:.0f} | "
            f"{sp['engine_scan10_vs_plain_time']:.3f} | "
            f"{'equal' if er['equal'] else 'DIFFERENT'} (resumed at step "
            f"{er['resumed_at']}) |"
        )
        name = g["device_kind"]
        line = f"- {name}: {g['machine']}."
        calls = g.get("calls")
        if calls:

            def spread(key, calls=calls):
                values = [c[key] for c in calls]
                middle = statistics.median(values)
                return f"median {middle:.2f} ({min(values):.2f}-{max(values):.2f})"

            line += (
                f" {len(calls)} calls of `gpu.py` (the row is one of them): engine / plain "
                f"time {spread('engine_vs_plain_time')}; `steps_per_dispatch=10` / plain "
                f"per-step time {spread('engine_scan10_vs_plain_time')}; the plain loop "
                f"{min(c['plain_steps_per_s'] for c in calls):.0f}-"
                f"{max(c['plain_steps_per_s'] for c in calls):.0f} steps/s."
            )
        notes.append(line)
        fc = g.get("flow_check")
        if fc:
            d, t = fc["demo"], fc["tests"]
            notes.append(
                f"- {name}, the flow (`{fc['command']}`): `prefect-jax demo` trained {d['steps']} "
                f"steps in {d['wall_s']} s wall (eval accuracy {d['eval_accuracy']}; start-up "
                f"{d['lost_s']['startup']} s, restore {d['lost_s']['restore']} s, compile "
                f"{d['lost_s']['compile']} s, checkpoints {d['lost_s']['checkpoint']} s); "
                f"{d['system_gpu_metrics']} `system/gpu_0_*` metrics, `prefect_jax.devices` = "
                f"`{d['devices_tag']}`; exports lowered for {', '.join(d['export_platforms'])}, "
                f"and {d['served_on_cpu']}. {t['passed']} tests passed on the GPU, {t['failed']} "
                f"failed ({', '.join(t['files'])}; left out: {t['left_out']})."
            )
            su = fc.get("startup")
            if su:
                again = su["demo_again"]
                notes.append(
                    f"- {name}, the demo's start-up, each piece in a fresh process: Python "
                    f"{su['python']} s, `import jax` {su['import jax']} s, JAX's client start "
                    f"{su['JAX client start']} s, `import prefect_jax.flows` "
                    f"{su['import prefect_jax.flows']} s, `import mlflow` {su['import mlflow']} "
                    f"s; the demo again with warm caches {again['wall_s']} s wall (start-up "
                    f"{again['startup']} s)."
                )
    if not out:
        return []
    return (
        out
        + [
            "",
            "`benchmarks/gpu.py` on a GPU machine lent to a session (not re-measured "
            "by this run): the engine (`Trainer`, no Prefect) against a plain jit + "
            "Orbax loop, a checkpoint and a full eval every `every` steps, the first "
            "interval untimed, and exact resume with buffer donation; "
            "`benchmarks/gpu_check.sh` "
            "runs the flow there.",
            "",
        ]
        + notes
    )


def lm_gpu_markdown() -> list[str]:
    """`benchmarks/lm.py`'s runs of the byte-level LM: on a lent GPU (LM-GPU-*.json) and on this
    project's CPUs (LM-CPU-*.json)."""
    import glob
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    out = []
    for path in sorted(glob.glob(os.path.join(here, "LM-*.json")), reverse=True):
        with open(path) as f:
            rec = json.load(f)
        out += [
            "",
            f"## The byte-level LM on {'a GPU' if '-GPU-' in path else 'CPU'} "
            f"(`lm.py`, {os.path.basename(path)})",
            "",
            f"{rec['device']}. {rec['note']}",
            "",
            "| run | side | steps (every) | loop s | tokens/s | MFU | stall per save, "
            "share of a sync save | mid-run stall per save (to the last step), share | "
            "to the last step s | a stretch with a save, beyond one without, s | end s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for i, run in enumerate(rec["runs"], 1):
            fpt = run.get("flops_per_token")
            peak = run.get("peak_flops") or 989e12
            floor = run["sides"].get("bare_nosave")
            saves = run["steps"] // run["checkpoint_every"] + (
                run["steps"] % run["checkpoint_every"] > 0
            )
            for name, side in run["sides"].items():
                mfu = side.get("mfu") or (fpt * side["tokens_per_s"] / peak if fpt else None)
                stall = mid_run = "-"
                if floor and name != "bare_nosave":
                    lost = (side["loop_s"] - floor["loop_s"]) / saves
                    stall = f"{lost:.2f} s, {lost / run['sync_save_s']:.0%}"
                    lost = mid_run_stall(side, floor, run["checkpoint_every"])
                    if lost is not None:
                        mid_run = f"{lost:.2f} s, {lost / run['sync_save_s']:.0%}"
                marks, boundary = side.get("marks"), side.get("per_save_boundary_s")
                out.append(
                    f"| {i} | {name} | {run['steps']} ({run['checkpoint_every']}) | "
                    f"{side['loop_s']:.1f} | {side['tokens_per_s']:,.0f} | "
                    f"{'-' if mfu is None else f'{mfu:.1%}'} | {stall} | {mid_run} | "
                    f"{f'{marks[-1][1]:.1f}' if marks else '-'} | "
                    f"{'-' if boundary is None else f'{boundary:.2f}'} | "
                    f"{fmt(side.get('end_s'), 2)} |"
                )
    return out


def mid_run_stall(side: dict, floor: dict, every: int) -> float | None:
    """The seconds a save cost a side mid-run, without the job's end: its time to the last mark
    beyond ``bare_nosave``'s, per save before that mark (what a save costs the stretches after
    it, as the device drains and refills, counts too). None where the sides' marks differ."""
    ours, theirs = side.get("marks"), floor.get("marks")
    if not ours or not theirs or [a for a, _ in ours] != [a for a, _ in theirs]:
        return None
    first, last = ours[0][0], ours[-1][0]
    saves = sum(1 for step in range(first + 1, last) if step % every == 0)
    if not saves:
        return None
    return ((ours[-1][1] - ours[0][1]) - (theirs[-1][1] - theirs[0][1])) / saves


def multiprocess_markdown(mp: dict | None) -> list[str]:
    """Two JAX processes against one (`multiprocess.py`)."""
    if not mp:
        return []
    sps, extra = mp["steps_per_s"], mp["checkpoint_interval_extra_ms"]
    block, ms = mp["save_block_ms"], mp["ms_per_step"]
    return [
        "",
        "## Several processes (`multiprocess.py`)",
        "",
        "| processes | ms per step | steps/s | vs 1 process | extra ms per checkpoint "
        "interval | save blocks ms |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| 1 | {ms['1']:.1f} | {sps['1']:.1f} | 1.00 | {extra['1']:.0f} | {block['1']:.0f} |",
        f"| 2 | {ms['2']:.1f} | {sps['2']:.1f} | {mp['throughput_2_vs_1']:.2f} | "
        f"{extra['2']:.0f} | {block['2']:.0f} |",
        "",
        f"{mp['work']}; the engine in one process against two (`jax.distributed` on "
        f"localhost, gloo). On this {mp['machine']} machine both processes share the same "
        f"cores, so this measures what the collectives (mostly gloo's all-reduce of the "
        "gradients), the agreement at log points and the collective checkpoint cost, not "
        "what a second host gains. `save blocks`: the part of a save the training thread "
        "waits for.",
    ]
