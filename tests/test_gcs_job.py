"""A job on gs:// (fake-gcs-server on loopback): Orbax writes the steps there itself, and the
job finds them again: it trains, is SIGKILLed, resumes exactly; a step without Orbax's GCS commit
file never counts, and one moved aside stops counting before it moves.

On GCS nothing renames a directory: Orbax commits a step by writing ``commit_success.txt`` in it
last (`names.GCS_COMMIT_FILE`), where on a local disk it renames the step's temporary
directory. The job's own listing reads that file; before it did, every gs:// job saw no committed
step and its second checkpoint failed ("Checkpoint for step 20 already exists").
"""

import json
import signal
import subprocess
import sys

import pytest
from conftest import GCS_BUCKET as BUCKET
from conftest import straight_fingerprint
from process_helpers import TESTS_DIR, cli_env, job_args, start_run, status, wait_until

PROGRAM, MAX_STEPS, EVERY = "programs:paced", 300, 50


def _write_step(root, step: int, committed: bool) -> None:
    for item in ("state", "data", "meta"):
        (root / str(step) / item).mkdir(parents=True, exist_ok=True)
        (root / str(step) / item / "x").write_text("x")
    if committed:
        (root / str(step) / "_CHECKPOINT_METADATA").write_text("{}")
        (root / str(step) / "commit_success.txt").write_text("ok")


def test_on_gcs_a_step_counts_by_orbaxs_commit_file_and_moves_aside_uncounted(gcs_env):
    from etils import epath

    from prefect_jax.training import checkpoint_dirs as dirs
    from prefect_jax.training import names

    url = f"gs://{BUCKET}/unit/checkpoints"
    root = epath.Path(url)
    assert dirs.step_dirs(url) == [] and dirs.committed_steps(url) == []
    _write_step(root, 10, committed=True)
    _write_step(root, 20, committed=False)  # a save killed before its commit
    assert dirs.step_dirs(url) == [10, 20]
    assert dirs.committed_steps(url) == [10]
    assert dirs.is_committed(f"{url}/10") and not dirs.is_committed(f"{url}/20")

    moved = dirs.quarantine(url, 20, "uncommitted")
    assert moved.startswith(f"{url}/20.uncommitted-") and dirs.step_dirs(url) == [10]
    moved = dirs.quarantine(url, 10, "corrupt")
    assert dirs.committed_steps(url) == [] and dirs.step_dirs(url) == []
    assert (epath.Path(moved) / "state" / "x").read_text() == "x"  # kept for inspection
    assert not (epath.Path(moved) / names.GCS_COMMIT_FILE).exists()  # never counts again


def test_on_gcs_a_reader_sees_a_step_another_process_committed_since_it_listed(gcs_env):
    """gcsfs keeps each listing for the process's life: an evaluator's checkpoints, listed once,
    would never show its trainer's next step. `Checkpoints.reload` drops the listing first."""
    from prefect_jax.training.checkpoints import Checkpoints

    url = f"gs://{BUCKET}/reader/checkpoints"
    write = (
        "import sys, jax.numpy as jnp, orbax.checkpoint as ocp\n"
        f"m = ocp.CheckpointManager({url!r})\n"
        "m.save(int(sys.argv[1]), args=ocp.args.StandardSave({'w': jnp.ones(3)}))\n"
        "m.wait_until_finished()\n"
    )
    subprocess.run([sys.executable, "-c", write, "10"], check=True, cwd=TESTS_DIR)
    reader = Checkpoints(url, read_only=True)
    assert reader.manager.all_steps() == [10]
    subprocess.run([sys.executable, "-c", write, "20"], check=True, cwd=TESTS_DIR)
    reader.reload()
    assert list(reader.manager.all_steps()) == [10, 20]


def test_storage_options_on_gcs_are_named_as_not_reaching_orbax(gcs_env, job_config, caplog):
    """A block's options (a gcsfs ``token``, a ``project``) reach the job's other files, never
    Orbax's steps, which take Google's default credentials: the job says so as it starts, naming
    the options (not their values), and says nothing where there are none. (A ``token`` here
    would send gcsfs's bucket-type lookup to the emulator over gRPC: a minute of timeouts.)"""
    import logging

    from prefect_jax.training.job import Job

    base = job_config().model_copy(update={"storage": f"gs://{BUCKET}/opts", "job": "opts"})
    for options, warned in (({"project": "team-project"}, True), ({}, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="prefect_jax.trainer"):
            job = Job(base.model_copy(update={"storage_options": options}))
        job.close()
        said = [
            r.getMessage() for r in caplog.records if "Orbax reads and writes" in r.getMessage()
        ]
        assert len(said) == warned, said
        assert not warned or ("['project']" in said[0] and "team-project" not in said[0])


def _run_args(mlflow_uri):
    storage = f"gs://{BUCKET}/team"
    return job_args(PROGRAM, "gjob", storage, MAX_STEPS, EVERY, mlflow_uri, "--exporters")


@pytest.mark.slow
def test_a_gcs_job_is_sigkilled_and_resumes_exactly(gcs_env, tmp_path, prefect_server, mlflow_uri):
    from prefect_jax.training.checkpoint_dirs import committed_steps

    checkpoints = f"gs://{BUCKET}/team/gjob/checkpoints"
    proc = start_run(_run_args(mlflow_uri), prefect_server, tmp_path / "1.log", **gcs_env.env)
    try:
        killed_after = wait_until(
            lambda: [s for s in committed_steps(checkpoints) if s < MAX_STEPS],
            300,
            "a step",
            proc,
            poll=0.05,
        )
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)

    env = cli_env(prefect_server, **gcs_env.env)
    committed = status("gjob", f"gs://{BUCKET}/team", env)["committed_steps"]
    assert committed[: len(killed_after)] == killed_after and MAX_STEPS not in committed

    rerun = subprocess.run(
        [sys.executable, "-m", "prefect_jax.cli", "run", *_run_args(mlflow_uri)],
        capture_output=True,
        text=True,
        env=env,
        cwd=TESTS_DIR,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout.splitlines()[-1])
    assert summary["final_step"] == MAX_STEPS
    assert f"job gjob at step {committed[-1]} (restored)" in rerun.stderr
    assert committed_steps(checkpoints)[-1] == MAX_STEPS

    expected = straight_fingerprint(PROGRAM, MAX_STEPS, EVERY, tmp_path / "local", mlflow_uri)
    assert summary["state_fingerprint"] == expected
