"""TF's ``keep_checkpoint_every_n_hours`` as ``CheckpointSpec(keep_every_secs=...)``: a real
job keeps the oldest committed step of each window of wall-clock time, for good, by the times the
steps record, on local storage (Orbax's retention) and on S3 (the uploads'), across a restart."""

from __future__ import annotations

import time
from functools import partial

import pytest

from prefect_jax.training.checkpoint_dirs import read_meta_file
from prefect_jax.training.policy import kept_by_time
from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec
from prefect_jax.training.trainer import Trainer

# Saves at least PAUSE apart, so that each run's 8 span several windows; an interval's save and
# upload on a loaded machine (CI's two cores) take up to about 1.5 s more, and a window this wide
# still holds several saves.
EVERY_SECS = 5.0
PAUSE = 0.75


@pytest.fixture(scope="module")
def s3_bucket(s3_server):
    s3_server.create_bucket("keep-by-time")
    return s3_server


def _config(where, tmp_path, s3_server, mlflow_uri, max_steps):
    storage = {"storage": str(tmp_path / "storage")}
    if where == "s3":
        storage = {"storage": "s3://keep-by-time/j", "storage_options": s3_server.storage_options}
    return JobConfig(
        program="prefect_jax.examples.digits:tiny",
        job="j",
        train=TrainSpec(max_steps=max_steps, log_every_steps=10),
        checkpoint=CheckpointSpec(
            every_steps=5, keep_last=1, keep_every_secs=EVERY_SECS, keep_until_evaluated=False
        ),
        mlflow_tracking_uri=mlflow_uri,
        **storage,
    )


def _train(config, saved: dict[int, float]) -> list[int]:
    """Train `config`'s job to its end, adding each step's recorded save time to `saved` as it
    commits (before a later save's retention can delete it); its committed steps at the end."""
    trainer = Trainer(config)
    trainer.restore_or_init()
    job = trainer.job
    read = (
        job.remote.read_meta if job.remote else partial(read_meta_file, job.checkpoints.directory)
    )
    while trainer.step < config.train.max_steps:
        time.sleep(PAUSE)
        trainer.train_until_checkpoint()
        job.wait_committed()  # (the step's upload and retention done)
        saved[trainer.step] = read(trainer.step)["saved_at"]
    steps = job.committed_steps()
    trainer.finish()
    trainer.close()
    return steps


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_oldest_step_of_each_window_is_kept_for_good_across_a_restart(
    where, tmp_path, request, mlflow_uri, monkeypatch
):
    s3_server = request.getfixturevalue("s3_bucket") if where == "s3" else None
    monkeypatch.setenv("PREFECT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    saved: dict[int, float] = {}
    first = _train(_config(where, tmp_path, s3_server, mlflow_uri, 40), saved)
    assert sorted(saved) == list(range(5, 41, 5))
    expected = kept_by_time(sorted(saved), saved.get, EVERY_SECS) | {40}  # (40: keep_last)
    assert first == sorted(expected), saved
    assert len(first) < len(saved), saved  # (saves share windows: some were dropped)

    again = _train(_config(where, tmp_path, s3_server, mlflow_uri, 80), saved)
    assert set(first) - {40} <= set(again)  # kept for good, by the times they recorded
    assert again == sorted(kept_by_time(sorted(saved), saved.get, EVERY_SECS) | {80}), saved
