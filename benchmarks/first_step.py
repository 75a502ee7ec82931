"""A compiled train step's first run against its later runs, in a bare JAX loop, for XLA flag
settings given on the command line: what a rerun's first new step costs beyond a step, and
whether a flag changes it (BENCHMARKS.md, Restart).

A program (default: the byte LM with `goodput_lm.py`'s params, the goodput job's model; or yours,
`--program package.module:attribute` with `--program-param KEY=VALUE`s, on one device), jitted
as a bare loop jits it (no Prefect, no prefect-jax engine). Each setting runs in fresh
processes, the settings alternated, each with a persistent compilation cache of its own that its
first process fills: the processes after it load the step from the cache, as a rerun does.

    uv run python benchmarks/first_step.py --flags "" \
        --flags=--xla_cpu_experimental_ynn_fusion_type= --runs 3 --steps 11
    uv run python benchmarks/first_step.py --program prefect_jax.examples.bytelm:program \
        --program-param preset=tiny --flags "" --flags=--xla_cpu_experimental_ynn_fusion_type=
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from prefect_jax.cli.role_arguments import add_program_params
from prefect_jax.cli.spec_flags import program_params_from_args

HERE = os.path.dirname(os.path.abspath(__file__))
HORIZON = 240  # the schedule's horizon (the goodput job's --steps): it shapes no step's cost


def load(args: argparse.Namespace):
    """The program `--program` names, built with its params (the engine's loader and the
    command's parsing), or by default the goodput job's byte LM. On one device a declared mesh
    has one device, and the loop jits without it; on several it is refused."""
    if args.program is None:
        sys.path.insert(0, HERE)
        import goodput_lm

        return goodput_lm.make_program(argparse.Namespace(steps=HORIZON, lm_params=None))
    import jax

    from prefect_jax.training.program import load_program
    from prefect_jax.training.sharding import declares_sharding

    program = load_program(args.program, program_params_from_args(args), max_steps=HORIZON)
    if declares_sharding(program) and jax.device_count() > 1:
        sys.exit(
            f"{args.program} declares a mesh (mesh_axes or shardings) and {jax.device_count()} "
            "devices are visible: this loop runs a program on one device; time it with one "
            "(CUDA_VISIBLE_DEVICES=0, or no --xla_force_host_platform_device_count)"
        )
    return program


def child(args: argparse.Namespace, cache: str) -> dict:
    """One process: the program's train step compiled (or loaded from `cache`), then
    `args.steps` runs of it on the program's batches, each timed to the end of its run."""
    import jax

    from prefect_jax.training.data_positions import iterate

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    program = load(args)
    steps = args.steps
    state = jax.block_until_ready(jax.jit(program.init)(jax.random.key(0)))
    it = iterate(program.train_data(0), getattr(program, "read_options", None))
    batch = next(it)
    began = time.perf_counter()
    step = jax.jit(program.train_step, donate_argnums=(0,)).lower(state, batch).compile()
    compile_s = time.perf_counter() - began
    runs, cpu = [], []
    for i in range(steps):
        batch = batch if i == 0 else next(it)
        began, cpu_began = time.perf_counter(), time.process_time()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        runs.append(time.perf_counter() - began)
        cpu.append(time.process_time() - cpu_began)
    return {"compile_s": compile_s, "runs_s": runs, "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--flags",
        action="append",
        help="an XLA_FLAGS value (repeat; '' for XLA's defaults; a value starting with -- as "
        "--flags=--xla_...)",
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="processes per setting after the one filling its cache"
    )
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--program", help="package.module:attribute (default: the byte LM)")
    add_program_params(parser.add_argument)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args, args.child)))
        return
    try:  # a malformed param refused before any process starts
        params = program_params_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    settings = args.flags if args.flags is not None else [""]
    with tempfile.TemporaryDirectory(prefix="first-step-") as tmp:
        caches = {flags: os.path.join(tmp, f"cache-{i}") for i, flags in enumerate(settings)}
        results: dict[str, list[dict]] = {flags: [] for flags in settings}
        for round_ in range(args.runs + 1):  # (round 0 fills each setting's cache)
            for flags in settings:
                env = {**os.environ, "XLA_FLAGS": flags}
                command = [sys.executable, __file__, "--steps", str(args.steps)]
                if args.program is not None:
                    command += ["--program", args.program]
                if params is not None:
                    command += ["--program-params", json.dumps(params)]
                done = subprocess.run(
                    [*command, "--child", caches[flags]], env=env, capture_output=True, text=True
                )
                if done.returncode != 0:
                    sys.exit(f"XLA_FLAGS={flags!r}: the process failed\n{done.stderr[-3000:]}")
                if round_ > 0:
                    results[flags].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(table(results))


def table(results: dict[str, list[dict]]) -> str:
    """A markdown row per setting: each process's first run, its later runs' mean, and their CPU
    seconds (user and system, all threads), then the step's load from the cache."""

    def later(values: list[float]) -> float:
        return sum(values[1:]) / max(1, len(values) - 1)

    columns = [
        lambda r: r["runs_s"][0],
        lambda r: r["cpu_s"][0],
        lambda r: later(r["runs_s"]),
        lambda r: later(r["cpu_s"]),
        lambda r: r["compile_s"],
    ]
    lines = [
        "| XLA_FLAGS | first run s | its CPU s | later runs s (mean) | their CPU s | load s |",
        "|---|---|---|---|---|---|",
    ]
    for flags, runs in results.items():
        cells = [", ".join(f"{column(r):.2f}" for r in runs) for column in columns]
        lines.append(f"| `{flags or '(defaults)'}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
