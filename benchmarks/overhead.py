"""Overhead of prefect-jax over a hand-written JAX + optax + Orbax loop.

Both sides train the same 64-256-256-10 MLP on scikit-learn digits for --steps steps, with
an async Orbax checkpoint and a full evaluation every --every steps:

- plain: jax.jit(train_step / eval_step), the program's Grain pipelines, a CheckpointManager.
- prefect_jax: the `train_and_evaluate` flow, against a throwaway Prefect server
  (`prefect_test_harness`, started before timing; reported as prefect_server_start_s).

Each side runs in its own fresh Python process (so neither inherits the other's warm caches:
the sklearn data, JAX's compiled eager ops). wall_s starts once the process has imported the
shared stack (jax, flax, optax, orbax, grain, the digits program; plus prefect_jax.flows, so
prefect, on the flow side) and covers everything else: init, compilation, training,
checkpoints, evals, the wait for the last save, and for the flow its own extra imports
(mlflow...), its Prefect API calls and its MLflow records.
Human-readable lines go to stderr; the last stdout line is one JSON object.

    uv run python benchmarks/overhead.py [--steps 2000] [--every 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def log(msg: str) -> None:
    print(f"[overhead] {msg}", file=sys.stderr, flush=True)


def import_jax_stack():
    """The imports both sides share, done before either clock starts."""
    import flax.nnx  # noqa: F401
    import grain  # noqa: F401
    import jax
    import optax  # noqa: F401
    import orbax.checkpoint  # noqa: F401

    import prefect_jax.examples.digits  # noqa: F401

    jax.devices()


def run_plain(steps: int, every: int, workdir: str) -> dict:
    t_import = time.perf_counter()
    import_jax_stack()
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from prefect_jax.examples.digits import DigitsProgram

    t0 = time.perf_counter()
    program = DigitsProgram(hidden=(256, 256), batch_size=128, dropout=0.0)  # as bench_programs.mlp
    donate = (0,) if jax.default_backend() != "cpu" else ()  # as the trainer does
    train_step = jax.jit(program.train_step, donate_argnums=donate)
    eval_step = jax.jit(program.eval_step)
    state = program.init(jax.random.key(0))
    batches = iter(program.train_data(0).to_iter_dataset())
    manager = ocp.CheckpointManager(
        os.path.join(workdir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True),
    )

    def evaluate(state) -> dict:
        totals: dict = {}
        for batch in program.eval_data():
            for k, pair in jax.device_get(eval_step(state, batch)).items():
                totals[k] = totals.get(k, 0) + np.asarray(pair, np.float64)
        return {k: float(s / n) for k, (s, n) in totals.items()}

    def savable(state):  # typed PRNG keys are not savable as is: store their raw key data
        is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
        return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, state)

    result, t_loop = {}, time.perf_counter()
    for step in range(1, steps + 1):
        state, metrics = train_step(state, next(batches))
        if step == 1:
            jax.block_until_ready(state)
            t_loop = time.perf_counter()
        if step % every == 0 or step == steps:
            manager.save(step, args=ocp.args.StandardSave(savable(state)), force=True)
            result = evaluate(state)
            log(f"plain step {step}: train loss {float(metrics['loss']):.4f}, eval {result}")
    jax.block_until_ready(state)
    loop_s = time.perf_counter() - t_loop
    manager.wait_until_finished()
    manager.close()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "loop_s": loop_s, "import_s": t0 - t_import, "eval": result,
            "jax": jax.__version__, "devices": str(jax.devices())}


def run_prefect_jax(steps: int, every: int, workdir: str) -> dict:
    t_import = time.perf_counter()
    import_jax_stack()
    sys.path.insert(0, HERE)  # for "bench_programs:mlp"
    from prefect_jax.flows import train_and_evaluate
    from prefect_jax.training.specs import CheckpointSpec, EvalSpec, TrainSpec

    t0 = time.perf_counter()
    summary = train_and_evaluate(
        program="bench_programs:mlp",
        job="bench",
        storage=workdir,
        train_spec=TrainSpec(max_steps=steps, log_every_steps=50),
        checkpoint_spec=CheckpointSpec(every_steps=every, keep_last=3),
        eval_spec=EvalSpec(),
        mlflow_tracking_uri=f"sqlite:///{workdir}/mlflow.db",
    )
    wall = time.perf_counter() - t0
    assert summary["final_step"] == steps, summary
    return {"wall_s": wall, "import_s": t0 - t_import, "eval": summary["eval"]}


SIDES = {"plain": run_plain, "prefect_jax": run_prefect_jax}


def run_side(name: str, args, env: dict) -> dict:
    """Run one side in a fresh process; its stderr passes through, its last stdout line is the result."""
    log(f"running {name} ...")
    cmd = [sys.executable, __file__, "--side", name, "--steps", str(args.steps), "--every", str(args.every)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        sys.exit(f"{name} failed (exit {proc.returncode})")
    for line in lines[:-1]:
        print(line, file=sys.stderr)
    result = json.loads(lines[-1])
    log(f"{name}: wall {result['wall_s']:.2f}s (imports {result['import_s']:.2f}s, not counted), eval {result['eval']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    parser.add_argument("--every", type=int, default=200, help="checkpoint + full eval every N steps (default 200)")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: one side, in a child
    args = parser.parse_args()

    if args.side:
        with tempfile.TemporaryDirectory(prefix=f"bench-{args.side}-") as workdir:
            print(json.dumps(SIDES[args.side](args.steps, args.every, workdir)), flush=True)
        return

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="bench-prefect-home-")  # before importing prefect
    import prefect.settings
    from prefect.testing.utilities import prefect_test_harness

    log(f"{args.steps} steps, checkpoint + eval every {args.every}; starting a Prefect server ...")
    t0 = time.perf_counter()
    with prefect_test_harness(server_startup_timeout=120):
        server_s = time.perf_counter() - t0
        log(f"Prefect server up in {server_s:.2f}s (not counted)")
        env = dict(os.environ, PREFECT_API_URL=prefect.settings.PREFECT_API_URL.value())
        plain = run_side("plain", args, env)
        pj = run_side("prefect_jax", args, env)

    ratio = pj["wall_s"] / plain["wall_s"]
    log(f"plain {plain['wall_s']:.2f}s (steps 2..{args.steps}: {plain['loop_s']:.2f}s), "
        f"prefect_jax {pj['wall_s']:.2f}s, ratio {ratio:.3f}")
    print(json.dumps({
        "benchmark": "overhead",
        "steps": args.steps,
        "checkpoint_every": args.every,
        "plain_wall_s": round(plain["wall_s"], 3),
        "plain_loop_s": round(plain["loop_s"], 3),
        "prefect_jax_wall_s": round(pj["wall_s"], 3),
        "ratio": round(ratio, 3),
        "prefect_server_start_s": round(server_s, 3),
        "plain_eval": plain["eval"],
        "prefect_jax_eval": pj["eval"],
        "machine": f"{platform.platform()}; {platform.machine()}; {os.cpu_count()} cpus; python {platform.python_version()}",
        "jax": plain["jax"],
        "devices": plain["devices"],
    }), flush=True)


if __name__ == "__main__":
    main()
