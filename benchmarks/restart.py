"""How fast a preempted job gets back to training, with and without JAX's compilation cache.

A job is trained to a checkpoint once. Then, each in a fresh Python process (as a rerun
after preemption is), the engine resumes it and runs one new step:

- ``no_cache``: no persistent compilation cache (the step is compiled from scratch);
- ``cache_cold``: cache enabled but empty (compiles and fills it);
- ``cache_warm``: cache enabled and filled by the previous run (what a rerun sees).

Then the job's storage on S3 (moto's server on loopback), each rerun on a new machine (its
own ``PREFECT_JAX_CACHE_DIR``: nothing local from the runs before): ``s3_no_cache``;
``s3_cache_cold`` (``compilation_cache_dir="job"``: compiles and copies its entries to the
bucket); ``s3_cache_new_machine`` (copies them in and loads the step instead of compiling it).
``cache_pulled`` is how many entries it copied in (in its ``setup_s``).

Each reports ``restart_to_first_step_s`` (from the process's first line to the end of the
first new step, imports included), and its parts: ``import_s``, ``setup_s`` (program, Orbax
manager; MLflow opens in the background), ``restore_s`` (lease + restore; the step's compile
starts in the background) and ``first_step_s`` (the rest of the compile or its cache load,
the step, the checkpoint dispatch); ``rerun_s`` is setup + restore + first step, the rerun
once its libraries are imported. Beside them, ``raw_restore_s`` and ``raw_step_s``: a bare
Orbax restore of the same checkpoint and one already-compiled step, the floor a restart
cannot beat.

    uv run python benchmarks/restart.py [--program prefect_jax.examples.digits:program]

Progress goes to stderr; the last stdout line is one JSON object.
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

T0 = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")


def child(args) -> dict:
    import fsspec
    import jax

    import prefect_jax.training.trainer as trainer_mod
    from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec

    t_import = time.perf_counter()
    config = JobConfig.model_validate_json(args.config)
    options = json.loads(args.storage_options or "{}")
    fs, root = fsspec.core.url_to_fs(config.storage, **options)
    names = [
        p.rstrip("/").rsplit("/", 1)[-1]
        for p in fs.ls(f"{root}/{config.job}/checkpoints", detail=False)
    ]
    latest = max(int(n) for n in names if n.isdigit())
    config = config.model_copy(
        update={
            "train": TrainSpec(max_steps=latest + 1),
            "checkpoint": CheckpointSpec(every_steps=1),
            "storage_options": options,
        }
    )
    trainer = trainer_mod.Trainer(config)
    t_setup = time.perf_counter()
    step = trainer.restore_or_init()
    t_restore = time.perf_counter()
    trainer.train_until_checkpoint()
    jax.block_until_ready(trainer.state)
    t_step = time.perf_counter()
    assert trainer.step == step + 1
    result = {
        "restart_to_first_step_s": t_step - T0,
        "import_s": t_import - T0,
        "setup_s": t_setup - t_import,
        "restore_s": t_restore - t_setup,
        "first_step_s": t_step - t_restore,
        "rerun_s": t_step - t_import,
        "cache_pulled": (
            len(trainer.compile_cache.pulled) if trainer.compile_cache is not None else None
        ),
    }
    # The floor: a bare Orbax restore of the same step, and one step
    # of an already-compiled function.
    trainer.job.checkpoints.wait()
    t = time.perf_counter()
    state, _ = trainer.job.checkpoints.restore(step + 1, trainer.loop.abstract_state)
    jax.block_until_ready(state)
    result["raw_restore_s"] = time.perf_counter() - t
    batch = next(trainer.data_iter)
    from prefect_jax.training.compiled_steps import metric_sums, new_guard

    shapes = jax.eval_shape(trainer.loop.program.train_step, state, batch)[1]
    guard = new_guard(0, metric_sums(shapes), 1, 1)
    state = trainer.loop.train_step(state, batch, guard)[
        0
    ]  # (the state is donated: the next step takes the new one)
    jax.block_until_ready(state)
    t = time.perf_counter()
    jax.block_until_ready(trainer.loop.train_step(state, batch, guard))
    result["raw_step_s"] = time.perf_counter() - t
    trainer.finish()
    trainer.close()
    return {k: v if v is None or isinstance(v, int) else round(v, 3) for k, v in result.items()}


def run_child(
    config_json: str,
    cache_dir: str | None,
    storage_options: dict | None = None,
    machine: str | None = None,
) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--config", config_json]
    if cache_dir:
        cmd += ["--cache", cache_dir]
    if storage_options:
        cmd += ["--storage-options", json.dumps(storage_options)]
    env = dict(os.environ, PREFECT_JAX_CACHE_DIR=machine) if machine else None
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"restart child failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_to_checkpoint(config) -> None:
    from prefect_jax.training.trainer import Trainer

    trainer = Trainer(config)
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.finish()
    trainer.close()


def s3_restarts(config, work: str) -> dict:
    """The job on S3 (moto on loopback), each rerun on a new machine: without a cache, filling
    the job's cache, and loading it."""
    sys.path.insert(0, TESTS)
    from s3_server import S3Server, isolate_aws_env

    isolate_aws_env()
    results = {}
    with S3Server() as s3:
        s3.create_bucket("restart")
        job = config.model_copy(
            update={"storage": "s3://restart/jobs", "storage_options": s3.storage_options}
        )
        train_to_checkpoint(job)
        runs = (("s3_no_cache", None), ("s3_cache_cold", "job"), ("s3_cache_new_machine", "job"))
        for i, (name, cache_dir) in enumerate(runs):
            machine = os.path.join(work, f"machine-{i}")
            results[name] = run_child(job.model_dump_json(), cache_dir, s3.storage_options, machine)
            print(f"[restart] {name}: {results[name]}", file=sys.stderr)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--program", default="prefect_jax.examples.digits:program")
    parser.add_argument("--steps", type=int, default=200, help="train this far before the restarts")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--storage-options", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.cache:
            config = json.loads(args.config)
            config["compilation_cache_dir"] = args.cache
            args.config = json.dumps(config)
        print(json.dumps(child(args)))
        return

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec

    work = tempfile.mkdtemp(prefix="prefect-jax-restart-")
    config = JobConfig(
        program=args.program,
        job="restart",
        storage=os.path.join(work, "storage"),
        train=TrainSpec(max_steps=args.steps),
        checkpoint=CheckpointSpec(every_steps=args.steps, keep_last=None),
        mlflow_tracking_uri=f"sqlite:///{work}/mlflow.db",
    )
    print(f"[restart] training {args.program} to step {args.steps} in {work}", file=sys.stderr)
    train_to_checkpoint(config)

    cache = os.path.join(work, "compile-cache")
    results = {}
    for name, cache_dir in (("no_cache", None), ("cache_cold", cache), ("cache_warm", cache)):
        results[name] = run_child(config.model_dump_json(), cache_dir)
        print(f"[restart] {name}: {results[name]}", file=sys.stderr)
    results.update(s3_restarts(config, work))
    warm = results["cache_warm"]
    floor = warm["raw_restore_s"] + warm["raw_step_s"]
    summary = {
        "benchmark": "restart",
        "program": args.program,
        **results,
        "warm_vs_no_cache_first_step": round(
            warm["first_step_s"] / results["no_cache"]["first_step_s"], 3
        ),
        "warm_rerun_vs_floor": round(warm["rerun_s"] / floor, 3),
        "s3_new_machine_vs_no_cache_first_step": round(
            results["s3_cache_new_machine"]["first_step_s"]
            / results["s3_no_cache"]["first_step_s"],
            3,
        ),
        "s3_measured": time.strftime("%Y-%m-%d %H:%M"),
        "machine": (
            f"{platform.platform()}; {os.cpu_count()} cpus; python {platform.python_version()}"
        ),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
