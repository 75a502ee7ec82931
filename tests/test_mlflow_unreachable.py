"""A tracking store MLflow cannot use or reach: refused before any work (the command and a
flow called directly), unless ``--mlflow-optional``, which trains without it and says so. Issue
53's fault families ``mlflow_unreachable`` (fast) and ``mlflow_restart`` (in
``benchmarks/faults_mlflow.py``): a tracking server that does not answer at the start, with
``--mlflow-optional``, costs the job no wait at all and the summary says what is missing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from deployment_helpers import free_port
from mlflow_server import MlflowServerProcess
from process_helpers import job_args, run_cli

TINY = "prefect_jax.examples.digits:tiny"


def test_a_store_an_optional_job_went_on_without_is_asked_again_by_a_job_that_needs_it():
    """The check's memory is per process (a notebook, a served flow): a job without
    mlflow_optional after one with it must be refused, not handed a tracker that sends nothing."""
    from prefect_jax.training.mlflow_client import TrackingWarning
    from prefect_jax.training.mlflow_reach import (
        TrackingUnreachableError,
        check_tracking_uri,
        found_unusable,
    )

    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.warns(TrackingWarning):
        check_tracking_uri(uri, optional=True)
    assert found_unusable(uri)
    check_tracking_uri(uri, optional=True)  # asked once: no second wait, no second warning
    with pytest.raises(TrackingUnreachableError, match="127.0.0.1"):
        check_tracking_uri(uri)


@pytest.mark.slow
def test_an_unanswering_server_with_mlflow_optional_costs_no_wait_and_is_said(tmp_path):
    """Each MLflow call against a server that does not answer waits out MLflow's own retries
    (minutes); the job ended only after every queued call had. Found unusable at the start, the
    job sends it nothing: it ends as soon as it trained, nothing in MLflow, and says so."""
    uri = f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_JAX_MLFLOW_STRICT"] = "0"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "prefect_jax.cli", "run"]
        + ["--program", "prefect_jax.examples.digits:tiny", "--job", "j"]
        + ["--storage", str(tmp_path / "s"), "--max-steps", "20"]
        + ["--checkpoint-every-steps", "10", "--log-every-steps", "5"]
        + ["--mlflow-tracking-uri", uri, "--mlflow-optional", "--no-progress", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
    )
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--mlflow-tracking-uri {uri}: MLflow cannot use it" in proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["final_step"] == 20 and summary["eval"]
    assert summary["mlflow_run_id"] is None
    assert not (tmp_path / "s" / "j" / "registry.json").exists()  # no version registered
    assert summary["mlflow_missing"].startswith(f"nothing of this run reached MLflow at {uri}")
    assert sorted(summary["exports"]) == ["best", "final", "latest"], summary["exports"]
    # MLflow's retries of one call alone take minutes; the job itself a fraction of that.
    assert took < 200, f"{took:.0f}s"


def _first_interval_on_a_server(job_config, tmp_path, max_steps: int):
    """A real MLflow server and a trainer tracking to it, its first 15 steps trained, evaluated
    and in the server's store (the caller kills the server)."""
    from prefect_jax.training.trainer import Trainer

    server = MlflowServerProcess(tmp_path, free_port())
    server.start(timeout=120)
    config = job_config(max_steps=max_steps, every_steps=15)
    trainer = Trainer(config.model_copy(update={"mlflow_tracking_uri": server.uri}))
    trainer.restore_or_init()
    trainer.train_until_checkpoint()
    trainer.evaluate_if_new()
    trainer.job.tracker.flush()
    return server, trainer


@pytest.mark.slow
def test_a_tracking_server_killed_and_restarted_mid_run_gets_every_metric_once(
    job_config, tmp_path, monkeypatch
):
    """The ``mlflow_restart`` family, small: the server SIGKILLed after the first checkpoint's
    metrics landed, two intervals trained and evaluated while it is down, then back on its port.
    MLflow's own retries carry the calls over the outage: every train and eval metric is in the
    run exactly once, and the run ends FINISHED."""
    from conftest import train_to_end
    from mlflow.tracking import MlflowClient

    # MLflow's retries of a call sooner after each other than its default (its public setting):
    # the same outage crossed, in less of the suite's time.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    server, trainer = _first_interval_on_a_server(job_config, tmp_path, max_steps=60)
    try:
        server.kill()
        for _ in range(2):  # (their MLflow calls wait out the outage in the worker)
            trainer.train_until_checkpoint()
            trainer.evaluate_if_new()
        time.sleep(2)
        server.start(timeout=120)
        train_to_end(trainer)
        trainer.finish()
        run_id = trainer.job.tracker.run_id
        trainer.close()
        client = MlflowClient(server.uri)
        assert client.get_run(run_id).info.status == "FINISHED"
        # (train metrics at each log point and at each checkpoint, as without the outage)
        train = sorted({*range(10, 61, 10), *range(15, 61, 15)})
        for key, want in (("train/loss", train), ("eval/loss", list(range(15, 61, 15)))):
            steps = sorted(m.step for m in client.get_metric_history(run_id, key))
            assert steps == want, (key, steps)
    finally:
        server.kill()


@pytest.mark.parametrize(
    "where", ["bogus://x", "http://127.0.0.1:{port}", "sqlite:///{tmp}/no/m.db"]
)
def test_a_tracking_uri_mlflow_cannot_use_or_reach_is_refused_before_any_work(tmp_path, where):
    uri = where.format(port=free_port(), tmp=tmp_path)
    storage = ("--storage", str(tmp_path / "s"))
    proc = run_cli("run", "--program", TINY, "--job", "j", *storage, "--mlflow-tracking-uri", uri)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"prefect-jax run: error: --mlflow-tracking-uri {uri}: "), lines[0]
    assert "pass --mlflow-optional to train without it" in lines[0]
    if where == "bogus://x":
        assert "Supported URI schemes are" in lines[0]  # MLflow's own list
    assert not (tmp_path / "s").exists()  # nothing trained, no job directory


def test_a_local_tracking_store_with_no_folder_is_refused_before_jax_is_imported(tmp_path):
    """Its answer needs no MLflow and no program: the command says it before JAX's import and
    the program's (seconds of a command's start-up), as soon as its arguments are read."""
    uri = f"sqlite:///{tmp_path}/no/m.db"
    argv = ["run", "--program", TINY, "--job", "j", "--storage", str(tmp_path / "s")]
    code = (
        "import sys\n"
        "from prefect_jax.cli import main\n"
        f"code = main({argv + ['--mlflow-tracking-uri', uri]!r})\n"
        "print(f'exit {code} jax imported: {\"jax\" in sys.modules}')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "exit 2 jax imported: False", proc.stdout + proc.stderr[-3000:]
    assert "the folder of its SQLite file" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_mlflow_optional_trains_and_the_summary_says_nothing_reached_mlflow(tmp_path):
    optional = ("--exporters", "--mlflow-optional")
    args = job_args(TINY, "j", tmp_path / "s", 10, 10, "bogus://x", *optional)
    proc = run_cli("run", *args, PREFECT_JAX_MLFLOW_STRICT="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--mlflow-tracking-uri bogus://x: MLflow cannot use it" in proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["final_step"] == 10 and summary["eval"]
    assert summary["mlflow_missing"].startswith("nothing of this run reached MLflow at bogus://x")
    # No MLflow UI or registered model to send the user to: the browse lines say what is missing.
    browse = "\n".join(summary["browse"])
    assert "mlflow ui" not in browse and "models:/" not in browse, browse
    assert "MLflow:  nothing of this run reached MLflow at bogus://x" in browse


def test_a_flow_called_with_a_tracking_uri_mlflow_cannot_use_fails_before_any_work(tmp_path):
    """A deployment's run does not come through the command: the flow asks MLflow first too."""
    from prefect_jax.flows import train_and_evaluate
    from prefect_jax.training.mlflow_reach import TrackingUnreachableError
    from prefect_jax.training.specs import TrainSpec

    with pytest.raises(TrackingUnreachableError, match="mlflow_tracking_uri bogus://x: MLflow"):
        train_and_evaluate.fn(
            program="prefect_jax.examples.digits:tiny",
            job="j",
            storage=str(tmp_path / "s"),
            train_spec=TrainSpec(max_steps=10),
            mlflow_tracking_uri="bogus://x",
        )
    assert not (tmp_path / "s").exists()


def test_a_flow_runs_tracking_uri_from_the_work_pools_environment_is_checked_too(
    tmp_path, monkeypatch
):
    """A deployment whose MLflow is given only as the worker's ``MLFLOW_TRACKING_URI`` was never
    checked: with its server down the run trained, then waited at its end for every queued call's
    retries (20 minutes and more, its lease held). It is refused before any work, naming the
    variable and the flow's way to go on without MLflow."""
    from prefect_jax.flows import train_and_evaluate
    from prefect_jax.training.mlflow_reach import TrackingUnreachableError
    from prefect_jax.training.specs import TrainSpec

    uri = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(TrackingUnreachableError) as refused:
        train_and_evaluate.fn(
            program=TINY, job="j", storage=str(tmp_path / "s"), train_spec=TrainSpec(max_steps=10)
        )
    message = str(refused.value)
    assert message.startswith(f"MLFLOW_TRACKING_URI {uri}: MLflow cannot use it"), message
    assert "set MLFLOW_TRACKING_URI (the work pool's environment" in message, message
    assert "mlflow_optional=true" in message and "--mlflow" not in message, message
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_a_jobs_end_with_its_tracking_server_gone_waits_one_check_not_every_calls_retries(
    job_config, tmp_path, monkeypatch, caplog
):
    """The server killed mid-run, never back: each queued call waits out MLflow's own retries
    (minutes each), and the job's end waited for all of them, its lease held, a SIGTERM waiting
    too. It waits while calls land or the store answers: here one check, then a warning, and the
    lease is freed."""
    import logging

    from prefect_jax.training import tracking

    monkeypatch.setenv("PREFECT_JAX_MLFLOW_STRICT", "0")
    monkeypatch.setattr(tracking, "ANSWER_CHECK_SECS", 2.0)
    server, trainer = _first_interval_on_a_server(job_config, tmp_path, max_steps=30)
    config = trainer.config
    try:
        server.kill()
        trainer.train_until_checkpoint()  # (its metrics queue behind MLflow's retries)
        trainer.evaluate_if_new()
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="prefect_jax.tracking"):
            trainer.finish()
        took = time.monotonic() - started
        lease = os.path.join(config.storage, config.job, "lease.json")
        assert not os.path.exists(lease)
        trainer.close()
        assert took < 60, f"the end waited {took:.0f}s"
        waited = re.search(r"write\(s\) still on their way after (\d+)s", caplog.text)
        assert waited and int(waited.group(1)) >= 4, caplog.text  # (two checks, 2 s apart)
        assert "the run may stay RUNNING, not FINISHED, until a later run" in caplog.text
    finally:
        server.kill()


@pytest.mark.slow
def test_mlflow_optional_with_the_environments_tracking_uri_unanswering_trains_at_once(
    tmp_path, monkeypatch, prefect_server
):
    """The same store with ``mlflow_optional``: found unusable as the run starts, its trackers send
    it nothing, and the run ends as soon as it trained, its summary saying what is missing."""
    from prefect_jax.flows import train_and_evaluate
    from prefect_jax.training.mlflow_client import TrackingWarning
    from prefect_jax.training.specs import CheckpointSpec, TrainSpec

    uri = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("PREFECT_JAX_MLFLOW_STRICT", "0")
    started = time.monotonic()
    with pytest.warns(TrackingWarning, match="mlflow_optional: training goes on"):
        summary = train_and_evaluate(
            program=TINY,
            job="j",
            storage=str(tmp_path / "s"),
            train_spec=TrainSpec(max_steps=10),
            checkpoint_spec=CheckpointSpec(every_steps=10),
            mlflow_optional=True,
        )
    assert summary["final_step"] == 10 and summary["mlflow_run_id"] is None
    assert summary["mlflow_missing"].startswith(f"nothing of this run reached MLflow at {uri}")
    assert time.monotonic() - started < 120  # (one MLflow call's own retries take minutes)


@pytest.mark.parametrize(
    "uri, said",
    [
        ("sqlite://mlflow.db", "not a SQLite URL: give sqlite:///<relative path>.db"),
        ("garbage", "a folder, MLflow's file store, which MLflow 3 refuses unless"),
        ("file:///tmp/mlruns", "MLFLOW_ALLOW_FILE_STORE=true"),
        ("sqlite:////nowhere/at/all/mlflow.db", "the folder of its SQLite file, /nowhere/at/all"),
        ("localhost:5000", "a server without its scheme: give http://localhost:5000"),
    ],
)
def test_a_local_store_mlflow_would_refuse_is_refused_before_the_job(uri, said, monkeypatch):
    """(A probe of the Python API: these passed the check, and the job trained with nothing
    recorded, MLflow's refusal only a warning.)"""
    from prefect_jax.training.mlflow_reach import TrackingUnreachableError, check_tracking_uri

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(TrackingUnreachableError, match=f"--mlflow-tracking-uri {uri}: "):
        check_tracking_uri(uri)
    with pytest.raises(TrackingUnreachableError) as refused:
        check_tracking_uri(uri)
    assert said in str(refused.value)


def test_the_local_stores_mlflow_takes_pass_the_check(tmp_path, monkeypatch):
    from prefect_jax.training.mlflow_reach import check_tracking_uri

    check_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    check_tracking_uri("sqlite:///:memory:")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_tracking_uri(str(tmp_path / "mlruns"))
