"""The engine on an accelerator: exact resume with buffer donation, and speed against a plain loop.

The engine donates the train state's buffers to each step (on the CPU too, since 2026-11-26);
this is where exact resume with donation is checked on a GPU. Without Prefect or MLflow (the device
machine has neither): `Trainer` alone, as in a notebook; MLflow is skipped with a warning if absent.

1. Exact resume: a job trained to 3 checkpoints in one trainer, and the same job trained to 1,
   its trainer dropped, then restored by a fresh trainer and trained on, end with the same
   `state_fingerprint`.
2. Speed: a 64-W-W-10 MLP on digits (batch B), --steps steps, a checkpoint and a full eval every
   --every steps: a plain jit loop with Orbax, the engine with one step per dispatch, and with
   `steps_per_dispatch=10`; steps per second and ratios to the plain loop, in one run.

    python benchmarks/gpu.py [--width 2048] [--batch 512] [--steps 3000] [--every 500]
        [--out gpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import jax
    import orbax.checkpoint as ocp

    from prefect_jax.examples import digits
    from prefect_jax.training.specs import CheckpointSpec, EvalSpec, JobConfig, TrainSpec
    from prefect_jax.training.trainer import Trainer

    program = digits.DigitsProgram(
        hidden=(args.width, args.width), batch_size=args.batch, dropout=0.1
    )
    digits.gpu_bench = program  # importable as prefect_jax.examples.digits:gpu_bench
    spec = "prefect_jax.examples.digits:gpu_bench"
    out: dict = {
        "devices": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "width": args.width,
        "batch": args.batch,
        "steps": args.steps,
        "every": args.every,
    }
    print(f"[gpu] {out['devices']}", flush=True)
    work = tempfile.mkdtemp(prefix="gpu-bench-")
    tracking = f"file://{work}/mlruns"

    def config(job, max_steps, every, dispatch=1):
        return JobConfig(
            program=spec,
            job=job,
            storage=work,
            train=TrainSpec(max_steps=max_steps, steps_per_dispatch=dispatch),
            checkpoint=CheckpointSpec(every_steps=every),
            eval=EvalSpec(),
            mlflow_tracking_uri=tracking,
        )

    # 1. Exact resume, donation on.
    every = 100
    straight = Trainer(config("straight", 3 * every, every))
    straight.restore_or_init()
    while straight.step < 3 * every:
        straight.train_until_checkpoint()
    want = straight.fingerprint()
    straight.finish()
    straight.close()
    first = Trainer(config("resumed", 3 * every, every))
    first.restore_or_init()
    first.train_until_checkpoint()
    first.finish()
    first.close()
    second = Trainer(config("resumed", 3 * every, every))
    resumed_at = second.restore_or_init()
    while second.step < 3 * every:
        second.train_until_checkpoint()
    got = second.fingerprint()
    second.finish()
    second.close()
    out["exact_resume"] = {"resumed_at": resumed_at, "equal": got == want, "fingerprint": want}
    print(
        f"[gpu] exact resume from step {resumed_at}: {'equal' if got == want else 'DIFFERENT'}",
        flush=True,
    )

    # 2. Speed.
    def plain() -> float:
        step_fn, eval_fn = (
            jax.jit(program.train_step, donate_argnums=(0,)),
            jax.jit(program.eval_step),
        )
        state = jax.jit(program.init)(jax.random.key(0))
        data = program.train_data(0)
        manager = ocp.CheckpointManager(
            os.path.join(work, "plain"), options=ocp.CheckpointManagerOptions(max_to_keep=3)
        )
        is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
        state, _ = step_fn(state, data[0])
        jax.block_until_ready(state)
        t = time.perf_counter()
        for i in range(1, args.steps):
            state, _ = step_fn(state, data[i])
            if (i + 1) % args.every == 0:
                manager.save(
                    i + 1,
                    args=ocp.args.StandardSave(
                        jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, state)
                    ),
                )
                for batch in program.eval_data():
                    jax.device_get(eval_fn(state, batch))
        manager.wait_until_finished()
        jax.block_until_ready(state)
        return time.perf_counter() - t

    def engine(dispatch: int, job: str) -> float:
        trainer = Trainer(config(job, args.steps, args.every, dispatch))
        trainer.restore_or_init()
        first_boundary = (
            trainer.train_until_checkpoint()
        )  # the first interval (its compile) is not timed
        trainer.evaluate_if_new()
        jax.block_until_ready(trainer.state)
        t = time.perf_counter()
        while trainer.step < args.steps:
            trainer.train_until_checkpoint()
            trainer.evaluate_if_new()
        trainer.job.wait_committed()
        jax.block_until_ready(trainer.state)
        seconds = (
            (time.perf_counter() - t) * (args.steps - 1) / (args.steps - first_boundary)
        )  # same steps as plain
        out.setdefault("goodput", {})[job] = trainer.goodput()
        trainer.finish()
        trainer.close()
        return seconds

    plain_s = plain()
    engine_s = engine(1, "engine")
    scan_s = engine(10, "engine_scan")
    n = args.steps - 1
    out["speed"] = {
        "plain_steps_per_s": n / plain_s,
        "engine_steps_per_s": n / engine_s,
        "engine_scan10_steps_per_s": n / scan_s,
        "engine_vs_plain_time": engine_s / plain_s,
        "engine_scan10_vs_plain_time": scan_s / plain_s,
    }
    print(
        f"[gpu] steps/s: plain {n / plain_s:.0f}, engine {n / engine_s:.0f}, "
        f"engine steps_per_dispatch=10 {n / scan_s:.0f}",
        flush=True,
    )
    line = json.dumps(out, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
