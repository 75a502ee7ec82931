"""Per-interval export cost on the training thread (issue 52): the digits program, three exporters
(latest, best, final), 5 intervals. Modes: every platform lowered synchronously (the old default),
this machine's platform and cpu synchronously (the new default), and the new default in the
background (the train flows' way: `Trainer.export_in_background`).

    uv run python benchmarks/export_cost.py [--intervals 5] [--out benchmarks/EXPORT_COST.json]

The cost is the training thread's time in the export calls, plus its wait for a background export
at the next one (or at `finish`); the next save's wait for it is in the interval's train time, so
train + export per interval is the number to compare. MLflow registration is off (it runs on its
own thread)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from prefect_jax.training.specs import (
    BestExporter,
    CheckpointSpec,
    EvalSpec,
    FinalExporter,
    JobConfig,
    LatestExporter,
    TrainSpec,
)
from prefect_jax.training.trainer import Trainer

EXPORTERS = [LatestExporter(), BestExporter(metric="accuracy", mode="max"), FinalExporter()]
MODES = {
    "sync, all platforms (before)": (["all"], False),
    "sync, default platforms": (None, False),
    "background, default platforms (after)": (None, True),
}


def run(root: str, mode: str, intervals: int, every: int) -> dict:
    platforms, background = MODES[mode]
    job = mode.split(",")[0] + str(platforms)
    config = JobConfig(
        program="prefect_jax.examples.digits:program",
        job="".join(c if c.isalnum() else "-" for c in job),
        storage=root,
        train=TrainSpec(max_steps=intervals * every, log_every_steps=every),
        checkpoint=CheckpointSpec(every_steps=every),
        eval=EvalSpec(exporters=EXPORTERS, registered_model="", export_platforms=platforms),
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    costs, trains = [], []
    while trainer.step < config.train.max_steps:
        t0 = time.perf_counter()
        trainer.train_until_checkpoint()
        trains.append(time.perf_counter() - t0)
        result = trainer.evaluate_if_new()
        t0 = time.perf_counter()
        if background:
            trainer.join_exports()  # (the next export's wait, counted here)
            trainer.export_in_background(result, on_done=lambda written: None)
        else:
            trainer.export(result)
        costs.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    trainer.join_exports()
    costs[-1] += time.perf_counter() - t0
    trainer.finish()
    trainer.close()
    return {
        "mode": mode,
        "export_secs_per_interval": costs,
        "median_after_first": statistics.median(costs[1:]),
        "first": costs[0],
        "train_secs_per_interval_median": statistics.median(trains[1:]),
        # train + export: a background export's wait at the next save is in the train part
        "interval_secs_median": statistics.median(
            [a + b for a, b in zip(trains[1:], costs[1:], strict=True)]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--intervals", type=int, default=5)
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for mode in MODES:
            rows.append(run(root, mode, args.intervals, args.every))
            r = rows[-1]
            print(
                f"{mode:40s} first {r['first']:.3f}s, then median {r['median_after_first']:.3f}s "
                f"per interval (train {r['train_secs_per_interval_median']:.3f}s, train + export "
                f"{r['interval_secs_median']:.3f}s)",
                flush=True,
            )
    if args.out:
        import os
        import platform

        import jax

        record = {
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "intervals": args.intervals,
            "every": args.every,
            "machine": {
                "cpus": os.cpu_count(),
                "jax": jax.__version__,
                "devices": str(jax.devices()),
                "os": platform.platform(),
            },
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
