"""Several JAX processes against one: training throughput and the per-interval cost of a
multi-process checkpoint, with the engine (no Prefect), on this machine.

For P in {1, 2} processes (`jax.distributed` on localhost, gloo collectives; each process one
CPU device), the same job trains the `wide` MLP (global batch 256: each process computes its
half when P = 2) for `--steps` steps twice: with a checkpoint every `--long` steps and every
`--short` steps. The first interval (compile, first save) is not timed. From the long run:
seconds per step; from the short one: the extra seconds per checkpoint interval over training
alone (the save's blocking part, the agreement between processes, the commit of the step
before), and, from the goodput ledger, how long each save blocked the training thread.
Process 0's figures are reported.

    uv run python benchmarks/multiprocess.py  # prints one JSON line, writes MULTIPROCESS.json

On a 2-core machine, two processes share the two cores the single process's XLA threads use:
the ratio says what the collectives and the split cost here, not what two GPU hosts gain.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args) -> None:
    sys.path.insert(0, HERE)
    from prefect_jax.training import CheckpointSpec, JobConfig, Trainer, TrainSpec

    def run(every: int) -> dict:
        config = JobConfig(
            program=args.program,
            job=f"mp-{every}",
            storage=args.storage,
            train=TrainSpec(max_steps=args.steps, log_every_steps=50),
            checkpoint=CheckpointSpec(every_steps=every, keep_last=2),
            mlflow_tracking_uri=args.mlflow,
        )
        trainer = Trainer(config)
        trainer.restore_or_init()
        times = []
        while trainer.step < args.steps:
            started = time.perf_counter()
            trainer.train_until_checkpoint()
            times.append(time.perf_counter() - started)
        started = time.perf_counter()
        trainer.finish()
        finish_s = time.perf_counter() - started
        saves = len(times)
        # The goodput ledger's checkpoint phase: how long the saves blocked the training thread.
        save_block_s = trainer.goodput().get("lost_s", {}).get("checkpoint", 0.0)
        trainer.close()
        timed = times[1:]  # the first interval compiles
        return {
            "every": every,
            "intervals": len(timed),
            "seconds": sum(timed),
            "steps": every * len(timed),
            "finish_s": finish_s,
            "save_block_ms": 1000 * save_block_s / saves,
        }

    long, short = run(args.long), run(args.short)
    per_step = long["seconds"] / long["steps"]
    extra = (short["seconds"] - per_step * short["steps"]) / short["intervals"]
    import jax

    if jax.process_index() == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "processes": jax.process_count(),
                    "devices": jax.device_count(),
                    "steps_per_s": 1 / per_step,
                    "ms_per_step": 1000 * per_step,
                    "checkpoint_interval_extra_ms": 1000 * extra,
                    "save_block_ms": short["save_block_ms"],
                    "long": long,
                    "short": short,
                }
            ),
            flush=True,
        )


def launch(processes: int, args) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    storage = tempfile.mkdtemp(prefix=f"mp-bench-{processes}-")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--storage",
        storage,
        "--mlflow",
        f"sqlite:///{storage}/mlflow.db",
        "--steps",
        str(args.steps),
        "--long",
        str(args.long),
        "--short",
        str(args.short),
        "--program",
        args.program,
    ]
    procs = []
    for k in range(processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PREFECT_JAX_MLFLOW_STRICT="0")
        if processes > 1:
            env.update(
                PREFECT_JAX_NUM_PROCESSES=str(processes),
                PREFECT_JAX_PROCESS_ID=str(k),
                PREFECT_JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            )
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        )
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
    return json.loads(
        next(line for line in outs[0].splitlines() if line.startswith("RESULT "))[len("RESULT ") :]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--storage", help=argparse.SUPPRESS)
    parser.add_argument("--mlflow", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument(
        "--program",
        default="bench_programs:wide",
        help="default bench_programs:wide (global batch 256)",
    )
    parser.add_argument(
        "--long",
        type=int,
        default=500,
        help="checkpoint cadence of the throughput run (default 500)",
    )
    parser.add_argument(
        "--short",
        type=int,
        default=100,
        help="checkpoint cadence of the per-interval run (default 100)",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="interleaved rounds of 1 and 2 processes (default 2)"
    )
    parser.add_argument("--out", default=os.path.join(HERE, "MULTIPROCESS.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    rounds = []
    for _ in range(args.rounds):
        rounds.append({str(p): launch(p, args) for p in (1, 2)})

    def median(values):
        values = sorted(values)
        return (
            values[len(values) // 2]
            if len(values) % 2
            else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
        )

    summary = {
        "work": f"{args.program}, {args.steps} steps, checkpoints every {args.long} / {args.short}",
        "machine": f"{os.cpu_count()} CPUs",
        "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "steps_per_s": {p: median([r[p]["steps_per_s"] for r in rounds]) for p in ("1", "2")},
        "checkpoint_interval_extra_ms": {
            p: median([r[p]["checkpoint_interval_extra_ms"] for r in rounds]) for p in ("1", "2")
        },
        "save_block_ms": {p: median([r[p]["save_block_ms"] for r in rounds]) for p in ("1", "2")},
        "ms_per_step": {p: median([r[p]["ms_per_step"] for r in rounds]) for p in ("1", "2")},
        "rounds": rounds,
    }
    summary["throughput_2_vs_1"] = summary["steps_per_s"]["2"] / summary["steps_per_s"]["1"]
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}))


if __name__ == "__main__":
    main()
