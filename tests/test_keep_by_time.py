"""TF's ``keep_checkpoint_every_n_hours`` as ``CheckpointSpec(keep_every_secs=...)``: a real
job keeps one committed step per interval of its saves, for good, by the times the steps record,
on local storage (Orbax's retention) and on S3 (the uploads' retention), across a restart."""

from __future__ import annotations

import time

import pytest

from prefect_jax.training.checkpoint_dirs import read_meta_file
from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec
from prefect_jax.training.trainer import Trainer

EVERY_SECS = 2.0
PAUSE = 0.35  # between intervals: saves about this far apart, so several fall in each interval


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


def _train(config):
    trainer = Trainer(config)
    trainer.restore_or_init()
    while trainer.step < config.train.max_steps:
        time.sleep(PAUSE)
        trainer.train_until_checkpoint()
        trainer.job.wait_committed()  # (each step's upload and retention done)
    steps = trainer.job.committed_steps()
    read = trainer.job.remote.read_meta if trainer.job.remote else None
    times = {
        s: (read(s) if read else read_meta_file(trainer.job.checkpoints.directory, s))
        for s in steps
    }
    trainer.finish()
    trainer.close()
    return steps, {s: m["saved_at"] for s, m in times.items()}


def _gaps(steps, at):
    return [at[b] - at[a] for a, b in zip(steps, steps[1:], strict=False)]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_one_step_per_interval_of_saves_is_kept_for_good_across_a_restart(
    where, tmp_path, request, mlflow_uri, monkeypatch
):
    s3_server = request.getfixturevalue("s3_bucket") if where == "s3" else None
    monkeypatch.setenv("PREFECT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    first, at = _train(_config(where, tmp_path, s3_server, mlflow_uri, 40))
    assert first[0] == 5 and first[-1] == 40  # the oldest, kept by time; the newest, keep_last
    assert len(first) < 8, first  # those saved within an interval of the last kept: deleted
    assert all(g >= EVERY_SECS for g in _gaps(first[:-1], at)), (first, at)

    again, at = _train(_config(where, tmp_path, s3_server, mlflow_uri, 80))
    assert set(first[:-1]) <= set(again) and again[-1] == 80  # kept for good, by their records
    assert all(g >= EVERY_SECS for g in _gaps(again[:-1], at)), (again, at)
