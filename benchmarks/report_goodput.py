"""BENCHMARKS.md's goodput-under-preemption sections (`goodput.py`: the digits job in a `run.py`
run, and every byte-LM record, GOODPUT-LM*.json) and the goodput part of the summary."""

from __future__ import annotations

import statistics

from report_common import fmt, mean_of, ratio_of, read_record


def goodput_summary(goodput: dict | None) -> dict:
    """From goodput.py's result: each run's goodput, the worst margin of prefect-jax over the best
    peer at the same period and signal, prefect-jax at T=60 s with SIGTERM, and the mean way
    back to the first new step after a preemption (prefect-jax / plain)."""
    if not goodput or not goodput.get("runs"):
        return {}
    runs = goodput["runs"]
    table = {
        f"{r['system']} T={r['period_s']:g} {r['signal']}": round(r["goodput"], 3) for r in runs
    }
    margins = []
    for period, sig in sorted({(r["period_s"], r["signal"]) for r in runs}):
        same = {
            r["system"]: r["goodput"] for r in runs if (r["period_s"], r["signal"]) == (period, sig)
        }
        peers = [v for k, v in same.items() if k != "prefect_jax"]
        if "prefect_jax" in same and peers:
            margins.append(same["prefect_jax"] - max(peers))
    t60 = [
        r["goodput"]
        for r in runs
        if r["system"] == "prefect_jax" and r["period_s"] == 60 and r["signal"] == "TERM"
    ]

    def restart(system):
        return mean_of(
            [x for r in runs if r["system"] == system for x in r["breakdown"].get("restart_s", [])]
        )

    pj, plain = restart("prefect_jax"), restart("plain")
    return {
        "table": table,
        "worst_margin": round(min(margins), 3) if margins else None,
        "t60_term": round(t60[0], 3) if t60 else None,
        "restart_vs_plain": ratio_of(pj, plain),
        "restart_s": {"prefect_jax": pj, "plain": plain, "keras": restart("keras")},
    }


LOST_COLUMNS = (
    "startup",
    "restore",
    "compile",
    "recomputed",
    "checkpoint",
    "eval",
    "other",
    "between_attempts",
)


def _goodput_runs_rows(goodput: dict) -> list[str]:
    """The runs table: a row per period, signal and system."""
    out = [
        "| T s | signal | system | attempts | total s | goodput | vs plain | rerun to first "
        "new step s (mean) |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    rounds = _round_count(goodput["runs"])
    for r in goodput["runs"]:
        restart = mean_of(r["breakdown"].get("restart_s", []))
        r = {**r, "system": r["system"] + _round_label(r, rounds)}
        if r.get("failed"):  # the job could not resume by itself (goodput 0 in the summary)
            out.append(
                f"| {r['period_s']:g} | SIG{r['signal']} | {r['system']} | {r['attempts']} "
                f"| {fmt(r['total_s'], 1)} | **could not resume**: `{r['failed'][:160]}` | "
                f"| |"
            )
            continue
        out.append(
            f"| {r['period_s']:g} | SIG{r['signal']} | {r['system']} | {r['attempts']} | "
            f"{fmt(r['total_s'], 1)} | {fmt(r['goodput'], 3)} | {fmt(r.get('vs_plain'), 3)} | "
            f"{fmt(restart)} |"
        )
    return out


def _round_count(runs: list[dict]) -> int:
    return len({r.get("repeat", 0) for r in runs})


def _round_label(run: dict, rounds: int) -> str:
    """`` (round N)`` after a run's system or signal where there are several (--repeats,
    --add-to: each round's rows in turn), else nothing."""
    return f" (round {run.get('repeat', 0) + 1})" if rounds > 1 else ""


def _goodput_mean_rows(runs: list[dict]) -> list[str]:
    """Each system's total seconds per period and signal: the mean over the rounds, and each
    round's (a run that never finished: "never")."""
    out = ["| T s | signal | system | mean total s | each round s |", "|---:|---|---|---:|---|"]
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["period_s"], r["signal"], r["system"]), []).append(r)
    for (period, sig, system), rs in cells.items():
        done = [r["total_s"] for r in rs if not r.get("failed")]
        mean = fmt(statistics.mean(done), 1) if len(done) == len(rs) else "never finished"
        each = ", ".join("never" if r.get("failed") else fmt(r["total_s"], 1) for r in rs)
        out.append(f"| {period:g} | SIG{sig} | {system} | {mean} | {each} |")
    return out


def _goodput_ledger_rows(goodput: dict) -> list[str]:
    """prefect-jax's own goodput ledger: a row per run, and the uninterrupted one first."""
    un = goodput["uninterrupted"]
    lost = " | ".join(c.replace("_", " ") for c in LOST_COLUMNS)
    out = [
        f"| T s | signal | ledger goodput | productive | {lost} |",
        "|---:|---|---:|---:|" + "---:|" * len(LOST_COLUMNS),
    ]
    rounds = _round_count(goodput["runs"])
    pj = [("uninterrupted", "", un.get("prefect_jax"))] + [
        (f"{r['period_s']:g}", f"SIG{r['signal']}{_round_label(r, rounds)}", r)
        for r in goodput["runs"]
        if r["system"] == "prefect_jax"
    ]
    for period, sig, r in pj:
        b = (r or {}).get("breakdown") or {}
        if b.get("source") != "ledger":
            continue
        out.append(
            f"| {period} | {sig} | {fmt(b['goodput_ledger'], 3)} | "
            f"{fmt(b['productive_s'], 1)} | "
            + " | ".join(fmt(b["lost_s"].get(c), 1) for c in LOST_COLUMNS)
            + " |"
        )
    return out


def _goodput_peer_rows(peers: list[dict]) -> list[str]:
    """The peers' start-up, restore and compile seconds, summed over a run's attempts; where the
    runs record them (the byte LM's plain loop), the restored steps evaluated again first."""
    again = any("evaluated_again" in r["breakdown"] for r in peers)
    out = [
        "| T s | signal | system | start-up | restore | compile |"
        + (" evaluated again (step) |" if again else ""),
        "|---:|---|---|---:|---:|---:|" + ("---|" if again else ""),
    ]
    rounds = _round_count(peers)
    for r in peers:
        lost = r["breakdown"]["lost_s"]
        row = (
            f"| {r['period_s']:g} | SIG{r['signal']} | {r['system']}{_round_label(r, rounds)} | "
            f"{fmt(lost['startup'], 1)} | {fmt(lost['restore'], 1)} | "
            f"{fmt(lost['compile'], 1)} |"
        )
        if again:
            steps = r["breakdown"].get("evaluated_again")
            row += f" {', '.join(map(str, steps)) or 'none'} |" if steps is not None else " - |"
        out.append(row)
    return out


def goodput_markdown(goodput: dict | None, summary: dict) -> list[str]:
    if not goodput or not goodput.get("runs"):
        return []
    un = goodput["uninterrupted"]
    out = ["", "## Goodput under preemption", ""] + _goodput_runs_rows(goodput)
    out += [
        "",
        f"`benchmarks/goodput.py`: `{goodput['program']}` (a 64-1024-1024-10 MLP, batch "
        f"256), {goodput['steps']} steps, a checkpoint and a full evaluation every "
        f"{goodput['every']}, each system in fresh processes, signalled T seconds after "
        "each start and restarted at once until one finishes. `goodput` = the system's "
        "uninterrupted wall / its total wall; `vs plain` = the plain loop's "
        "uninterrupted wall / this total. Uninterrupted: "
        + ", ".join(f"{k} {fmt(v['total_s'], 1)} s" for k, v in un.items())
        + ". The plain loop has no SIGTERM handler; Keras backs up at epoch ends. One run of "
        "each: read differences under ~0.1 as noise.",
    ]
    sized = goodput.get("sized")
    if sized:  # the job was lengthened to outlast the periods (goodput.py --min-periods)
        before = min(u["total_s"] for u in sized["uninterrupted_before"].values())
        out[-1] += (
            f" The job was sized to the cores: {sized['steps_before']} steps took "
            f"{before:.1f} s, under {sized['min_wall_s']:g} s (`--min-periods`), so "
            f"{goodput['steps']} steps."
        )
    if goodput.get("note"):  # where these rows come from, when not from this run (see --render)
        out += ["", goodput["note"]]
    out += ["", *_goodput_ledger_rows(goodput)]
    out += [
        "",
        "Where prefect-jax's time went, seconds, from the job's own goodput ledger "
        "(`<job>/goodput.json`, also in MLflow as `goodput/*` and in the Prefect table "
        "artifact `<job>-goodput`).",
    ]
    peers = [r for r in goodput["runs"] if r["breakdown"].get("source") == "marks"]
    if peers:
        out += ["", *_goodput_peer_rows(peers)]
        out += [
            "",
            "The peers' time, seconds summed over attempts, from their processes' marks "
            "(start, imports done, restored, first step).",
        ]
    return out


def mean_uninterrupted(rounds: list[dict[str, dict]]) -> dict[str, float]:
    """Each system's mean uninterrupted wall over a goodput result's rounds."""
    systems = {s for r in rounds for s in r}
    return {s: sum(r[s]["total_s"] for r in rounds) / len(rounds) for s in sorted(systems)}


def _rounds(goodput: dict) -> list[dict[str, dict]]:
    return goodput.get("uninterrupted_repeats") or [goodput["uninterrupted"]]


def _goodput_verdicts(runs: list[dict], reference: dict[str, float]) -> str:
    """prefect-jax's goodput minus each peer's, per period and signal, each system's goodput
    taken against the given uninterrupted walls (a run that never finished: 0), averaged over
    the rounds; where there are several, each round's difference follows in brackets (whether
    the sign holds from round to round, on a VM whose runs move by seconds)."""
    verdicts = []
    for period, sig in sorted({(r["period_s"], r["signal"]) for r in runs}):
        cell: dict[str, dict[int, float]] = {}
        for r in runs:
            if (r["period_s"], r["signal"]) == (period, sig):
                value = 0.0 if r.get("failed") else reference[r["system"]] / r["total_s"]
                cell.setdefault(r["system"], {})[r.get("repeat", 0)] = value
        pj = cell.get("prefect_jax")
        for peer, values in cell.items():
            if peer == "prefect_jax" or pj is None:
                continue
            gap = statistics.mean(pj.values()) - statistics.mean(values.values())
            each = [pj[k] - values[k] for k in sorted(pj) if k in values]
            verdicts.append(
                f"T={period:g} SIG{sig} vs {peer}: {gap:+.3f}"
                + (f" (rounds: {', '.join(f'{d:+.3f}' for d in each)})" if len(each) > 1 else "")
                + ("" if gap >= 0 else " (**below**)")
            )
    return "; ".join(verdicts)


def goodput_lm_markdown() -> list[str]:
    """`goodput.py --model lm`: the same preemptions on the byte LM, with the verdict per period
    and signal (prefect-jax's goodput against each peer's): GOODPUT-LM.json, then each later
    record kept beside it (GOODPUT-LM-<when>.json, its ``title`` the heading of its own part)."""
    import glob
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    out = _goodput_lm_part(
        read_record("GOODPUT-LM.json"), "## Goodput under preemption: the byte LM"
    )
    for path in sorted(glob.glob(os.path.join(here, "GOODPUT-LM-*.json"))):
        gp = read_record(os.path.basename(path))
        out += _goodput_lm_part(gp, f"### {gp.get('title', os.path.basename(path))}")
    return out


def _all_of(n: int) -> str:
    """``both`` or ``all three`` (systems)."""
    return "both" if n == 2 else f"all {({3: 'three', 4: 'four'}).get(n, n)}"


def _goodput_lm_part(gp: dict | None, heading: str) -> list[str]:
    """One `goodput.py --model lm` record under `heading`: its runs, verdicts and ledgers."""
    if not gp or not gp.get("runs"):
        return []
    un, lm, rounds = gp["uninterrupted"], gp["lm"], _rounds(gp)
    reference = mean_uninterrupted(rounds)
    counts = next((r["param_counts"] for r in un.values() if r.get("param_counts")), {})
    out = ["", heading, ""] + _goodput_runs_rows(gp)
    params = ", ".join(f"{k}={v}" for k, v in lm["params"].items())
    each = "; ".join(
        f"{s} " + " and ".join(fmt(r[s]["total_s"], 1) for r in rounds) + " s" for s in reference
    )
    out += [
        "",
        f"`benchmarks/goodput.py --model lm` ({gp.get('measured', 'this run')}): "
        f"`{gp['program']}` with {params} ({lm['param_count']:,} parameters"
        + (f"; the Keras model: {counts['keras']:,}" if counts.get("keras") else "")
        + f"), {gp['steps']} steps of {lm['tokens_per_step']} "
        f"tokens, a checkpoint and an evaluation ({lm['corpus']['eval_windows']} eval windows) "
        f"every {gp['every']} steps, the same corpus shards for {_all_of(len(reference))} systems, "
        f"{len(rounds)} round(s) of every run. Uninterrupted: {each}. Columns as in "
        "[Goodput under preemption](#goodput-under-preemption); `goodput` and `vs plain` "
        "divide by the mean uninterrupted wall.",
    ]
    if len(rounds) > 1:
        out += ["", *_goodput_mean_rows(gp["runs"])]
    out += [
        "",
        "prefect-jax's goodput minus each peer's, each against its own uninterrupted runs"
        + (", means over the rounds" if len(rounds) > 1 else "")
        + ": "
        + _goodput_verdicts(gp["runs"], reference)
        + ".",
    ]
    if "plain" in reference:  # one reference for all: the ordering of the total seconds
        common = {system: reference["plain"] for system in reference}
        out += [
            "",
            "The same, each against the plain loop's uninterrupted runs (the `vs plain` column): "
            + _goodput_verdicts(gp["runs"], common)
            + ".",
        ]
    if gp.get("note"):
        out += ["", gp["note"]]
    out += ["", *_goodput_ledger_rows(gp), ""]
    out.append("Where prefect-jax's time went, seconds, from the job's goodput ledger.")
    peers = [r for r in gp["runs"] if r["breakdown"].get("source") == "marks"]
    if peers:
        out += ["", *_goodput_peer_rows(peers), ""]
        out.append(
            "The peers' time, seconds summed over attempts, from their processes' marks. "
            "Evaluated again: a restored step whose evaluation a kill interrupted, evaluated "
            "before training goes on (as prefect-jax does; not counted as compile)."
        )
    return out
