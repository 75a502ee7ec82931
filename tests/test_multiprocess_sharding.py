"""A program whose state is sharded over several JAX processes: the tiny byte LM, FSDP over the
4 CPU devices of two processes (2 each), trained, evaluated and exported by
``prefect-jax run --processes 2``, against the same job in one process of 4 devices; its
checkpoint resumed in this one process (1 device); and the same two processes with one of them
SIGKILLed mid-job, resumed exactly.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from process_helpers import TESTS_DIR, cli_env, job_args, start_run, wait_until
from test_multiprocess import _free_port, _summary, _wait_all

from prefect_jax.training.checkpoint_dirs import committed_steps

PROGRAM = "prefect_jax.examples.bytelm:tiny"  # its mesh: every device on "data" (FSDP)
MAX_STEPS, EVERY = 20, 10


def _args(tmp, job: str, mlflow_uri: str, max_steps: int = MAX_STEPS) -> list[str]:
    return job_args(PROGRAM, job, tmp / job, max_steps, EVERY, mlflow_uri, "--log-every-steps", "5")


def _run(
    tmp,
    job: str,
    mlflow_uri: str,
    api_url: str,
    devices: int,
    processes: int,
    max_steps: int = MAX_STEPS,
    log_name: str | None = None,
) -> dict:
    """``prefect-jax run`` of the job, each process with `devices` CPU devices: its summary."""
    log = tmp / f"{log_name or job}.log"
    args = _args(tmp, job, mlflow_uri, max_steps) + ["--processes", str(processes)]
    flags = f"--xla_force_host_platform_device_count={devices}"
    with open(log, "w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "prefect_jax.cli", "run", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cli_env(api_url, XLA_FLAGS=flags),
            cwd=TESTS_DIR,
            timeout=600,
        )
    assert done.returncode == 0, log.read_text()[-4000:]
    return _summary(log)


def _restored(tmp, job: str, mlflow_uri: str, max_steps: int = MAX_STEPS):
    from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec
    from prefect_jax.training.trainer import Trainer

    return Trainer(
        JobConfig(
            program=PROGRAM,
            job=job,
            storage=str(tmp / job),
            train=TrainSpec(max_steps=max_steps, log_every_steps=5),
            checkpoint=CheckpointSpec(every_steps=EVERY),
            mlflow_tracking_uri=mlflow_uri,
        )
    )


@pytest.mark.slow
def test_an_fsdp_state_over_two_processes_trains_evaluates_exports_and_resumes_in_one(
    tmp_path, prefect_server, mlflow_uri
):
    import jax

    from prefect_jax.training.trees import leaf_paths, to_savable

    two = _run(tmp_path, "two", mlflow_uri, prefect_server, devices=2, processes=2)
    one = _run(tmp_path, "one", mlflow_uri, prefect_server, devices=4, processes=1)
    assert two["final_step"] == one["final_step"] == MAX_STEPS
    # Evaluated by both processes on the global sharded state, recorded and exported by process 0.
    assert set(two["eval"]) == {"accuracy", "bits_per_byte", "loss", "perplexity"}
    for name, value in one["eval"].items():
        assert two["eval"][name] == pytest.approx(value, rel=1e-5), name
    assert two["exports"] == one["exports"] == {"best": [10, 20], "final": [20], "latest": [10, 20]}
    for exporter in ("latest", "final"):
        assert os.path.exists(tmp_path / "two" / "two" / "exports" / exporter / "20")

    # The 2-process checkpoint, saved by both processes without a gather, restores into this
    # process's one device bit for bit: the fingerprint gathered from the two processes.
    trainer = _restored(tmp_path, "two", mlflow_uri, MAX_STEPS + EVERY)
    assert trainer.restore_or_init() == MAX_STEPS
    assert trainer.fingerprint() == two["state_fingerprint"]
    state_two = dict(leaf_paths(jax.device_get(to_savable(trainer.state))))
    reference = _restored(tmp_path, "one", mlflow_uri)
    reference.restore_or_init()
    assert reference.fingerprint() == one["state_fingerprint"]
    # The same job in one process of 4 devices: the same state, to float32 rounding (gloo's
    # all-reduce between processes sums the 4 devices' gradients in another order than the
    # CPU's in-process collectives).
    for path, leaf in leaf_paths(jax.device_get(to_savable(reference.state))):
        np.testing.assert_allclose(state_two[path], leaf, rtol=1e-5, atol=1e-6, err_msg=path)
    reference.close()
    # And trains on there.
    trainer.train_until_checkpoint()
    assert trainer.step == MAX_STEPS + EVERY and np.isfinite(trainer.last_train_metrics["loss"])
    trainer.finish()
    trainer.close()


@pytest.mark.slow
def test_a_sharded_job_with_a_process_killed_ends_in_both_and_the_rerun_resumes_exactly(
    tmp_path, prefect_server, mlflow_uri
):
    """Issue 52, a state sharded over two processes: process 1 SIGKILLed mid-job (in a step, an
    evaluation of the global state, a gather for the exports or a save: wherever it lands) ends
    process 0 too, within the peer watch's bounds, not at JAX's heartbeat timeout nor never; the
    rerun resumes from the newest step both committed to the state of the same job never
    killed, bit for bit (the same two processes: the same order of every sum)."""
    steps = 6 * EVERY
    whole = _run(tmp_path, "whole", mlflow_uri, prefect_server, 2, 2, max_steps=steps)
    assert whole["final_step"] == steps

    port = _free_port()
    cluster = dict(
        PREFECT_JAX_NUM_PROCESSES="2",
        PREFECT_JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    args = _args(tmp_path, "killed", mlflow_uri, steps)
    procs = [
        start_run(
            args,
            prefect_server,
            tmp_path / f"killed.{k}.log",
            PREFECT_JAX_PROCESS_ID=str(k),
            **cluster,
        )
        for k in range(2)
    ]
    checkpoints = str(tmp_path / "killed" / "killed" / "checkpoints")
    wait_until(lambda: EVERY in committed_steps(checkpoints), 300, "a first step", procs[0])
    time.sleep(0.3)
    procs[1].send_signal(signal.SIGKILL)
    started = time.monotonic()
    codes = _wait_all(procs, 120)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, codes
    assert time.monotonic() - started < 90  # (JAX's own heartbeat timeout, here 30 s, plus margin)
    committed = committed_steps(checkpoints)
    assert committed and max(committed) < steps, committed

    rerun = _run(
        tmp_path, "killed", mlflow_uri, prefect_server, 2, 2, max_steps=steps, log_name="rerun"
    )
    assert rerun["final_step"] == steps
    assert rerun["state_fingerprint"] == whole["state_fingerprint"]
    assert rerun["eval"] == whole["eval"]  # the final evaluation, of the same global state
    assert rerun["exports"]["final"] == [steps] and rerun["exports"]["latest"][-1] == steps
