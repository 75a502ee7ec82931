"""Issue 53's fault families ``mlflow_unreachable`` (fast) and ``mlflow_restart`` (in
``benchmarks/faults_mlflow.py``): a tracking server that does not answer at the start, with
``--mlflow-optional``, costs the job no wait at all and the summary says what is missing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_an_unanswering_server_with_mlflow_optional_costs_no_wait_and_is_said(tmp_path):
    """Each MLflow call against a server that does not answer waits out MLflow's own retries
    (minutes); the job ended only after every queued call had. Found unusable at the start, the
    job sends it nothing: it ends as soon as it trained, nothing in MLflow, and says so."""
    uri = f"http://127.0.0.1:{_closed_port()}"
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
