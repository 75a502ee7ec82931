"""Credentials live in a CheckpointStorage block and reach the filesystem only.

A job runs on s3:// (moto's server on loopback) with its storage named by block; a planted
secret is then searched for in everything the run wrote: Prefect logs, flow-run parameters,
artifacts and events; MLflow params and tags; every small file in the bucket (checkpoint
metadata, eval records, exports, lease); the local stage; and the command's own output.
"""

import json
import os
import re
import subprocess
import sys

import httpx
import pytest
from mlflow.tracking import MlflowClient
from s3_server import isolate_aws_env

from prefect_jax.blocks import CheckpointStorage

pytestmark = pytest.mark.slow

PLANTED = "s3cr3t-PLANTED-7f3a9c2e"


@pytest.fixture(scope="module")
def s3(s3_server):
    s3_server.create_bucket("secret-jobs")
    return s3_server


def _post(api, path, body):
    response = httpx.post(f"{api}{path}", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.text


def test_a_planted_secret_appears_nowhere(s3, tmp_path, prefect_server, mlflow_uri, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_JAX_CACHE_DIR", str(tmp_path / "cache"))
    isolate_aws_env(os.environ)
    s3.save_block("leak-test", "s3://secret-jobs/team", secret=PLANTED)

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_API_URL=prefect_server, PREFECT_LOGGING_LEVEL="DEBUG")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect_jax.cli",
            "run",
            "--program",
            "prefect_jax.examples.digits:tiny",
            "--job",
            "leaky",
            "--storage",
            "jax-checkpoint-storage/leak-test",
            "--max-steps",
            "40",
            "--checkpoint-every-steps",
            "20",
            "--log-every-steps",
            "10",
            "--exporters",
            "latest",
            "--mlflow-tracking-uri",
            mlflow_uri,
            "--json",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["final_step"] == 40
    flow_run_id = re.search(r"/runs/flow-run/([0-9a-f-]{36})", proc.stderr).group(1)
    places = {
        "command output": proc.stdout + proc.stderr,
        "prefect logs": _post(
            prefect_server,
            "/logs/filter",
            {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200},
        ),
        "flow run": httpx.get(f"{prefect_server}/flow_runs/{flow_run_id}", timeout=30).text,
        "artifacts": _post(
            prefect_server,
            "/artifacts/filter",
            {
                "artifacts": {"flow_run_id": {"any_": [flow_run_id]}},
                "sort": "CREATED_DESC",
                "limit": 200,
            },
        ),
        "events": _post(
            prefect_server,
            "/events/filter",
            {"filter": {"event": {"prefix": ["prefect-jax."]}}, "limit": 50},
        ),
    }
    run = MlflowClient(mlflow_uri).get_run(summary["mlflow_run_id"])
    places["mlflow params"] = json.dumps(run.data.params)
    places["mlflow tags"] = json.dumps(run.data.tags)
    fs = s3.filesystem()
    files = [p for p in fs.find("secret-jobs/team/leaky") if fs.size(p) < 1_000_000]
    assert any(p.endswith("/meta/metadata") for p in files) and any(
        p.endswith("export.json") for p in files
    )
    for path in files:
        places[f"s3://{path}"] = fs.cat_file(path).decode(errors="replace")
    for root, _, names in os.walk(tmp_path / "cache"):
        for name in names:
            path = os.path.join(root, name)
            if os.path.getsize(path) < 1_000_000:
                places[path] = open(path, "rb").read().decode(errors="replace")

    # The searches read real content (so "not found" means something).
    assert "jax-checkpoint-storage/leak-test" in places["flow run"]
    assert (
        "its checkpoint saving" in places["prefect logs"]
        and "prefect-jax.checkpoint.committed" in places["events"]
    )
    assert "train.max_steps" in places["mlflow params"]
    # The description's status hint names the block (it carries the endpoint and the keys), not
    # the bucket URL it resolved to, which `prefect-jax status` could not open without them.
    assert "--storage jax-checkpoint-storage/leak-test`" in run.data.tags["mlflow.note.content"], (
        run.data.tags["mlflow.note.content"]
    )
    assert any(
        '"step": 40' in a["data"] for a in json.loads(places["artifacts"]) if a["type"] == "table"
    )
    # The evaluator role reads the same bucket (its own eval name, so it has work to do).
    from prefect_jax.flows import evaluate
    from prefect_jax.training.specs import CheckpointSpec, EvalSpec, TrainSpec

    evaluated = evaluate(
        program="prefect_jax.examples.digits:tiny",
        job="leaky",
        storage="jax-checkpoint-storage/leak-test",
        train_spec=TrainSpec(max_steps=40),
        checkpoint_spec=CheckpointSpec(every_steps=20),
        eval_spec=EvalSpec(name="second-opinion"),
        mlflow_tracking_uri=mlflow_uri,
        poll_secs=0.2,
    )
    assert evaluated["evaluated"] == [20, 40]
    assert sorted(fs.ls("secret-jobs/team/leaky/evals/second-opinion", detail=False))[-1].endswith(
        "40.json"
    )

    leaked = [where for where, text in places.items() if PLANTED in text]
    assert leaked == []
    assert PLANTED not in repr(CheckpointStorage.load("leak-test"))
