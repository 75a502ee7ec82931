"""The README's own program and commands, as a newcomer copies them: its whole `mypkg/model.py`,
trained by its `prefect-jax run` command from the folder holding it (the console script, which
must import from the working directory as ``python -m`` does), then its `status` command; and its
Python call of the `train_and_evaluate` flow. A README edit that breaks them fails here."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from process_helpers import cli_env

README = Path(__file__).parents[1] / "README.md"
pytestmark = pytest.mark.slow


def _readme_block(language: str, marker: str) -> str:
    """The one ```language block of the README that contains `marker`."""
    blocks = re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def _command(block: str, command: str) -> list[str]:
    """The arguments of the README's ``uv run prefect-jax <command> ...`` in `block` (its lines
    continued with a backslash joined, its comment cut)."""
    lines = block.replace("\\\n", " ").splitlines()
    (line,) = [x for x in lines if x.strip().startswith(f"uv run prefect-jax {command} ")]
    return shlex.split(line, comments=True)[3:]


def _console_script(*args: str, cwd: Path, api_url: str) -> subprocess.CompletedProcess:
    """``prefect-jax ARGS`` (the installed console script, as ``uv run prefect-jax`` runs it) in
    `cwd`, reporting to the session's Prefect server."""
    script = Path(sys.executable).parent / "prefect-jax"
    env = cli_env(api_url)  # (less the tests' folder, and any empty part: that would be cwd)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p
    )
    return subprocess.run(
        [str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


def test_the_readmes_program_trains_from_the_folder_holding_it_and_its_status_reads(
    tmp_path, prefect_server
):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(_readme_block("python", "class Program:"))
    commands = _readme_block("bash", "--program mypkg.model:program")
    storage, tracking = tmp_path / "runs", f"sqlite:///{tmp_path}/mlflow.db"
    # The README's flags, then this test's (argparse keeps the last of each): its own folders
    # and a short job (the README's is 20000 steps with a checkpoint every 1000).
    ours = ["--storage", str(storage), "--mlflow-tracking-uri", tracking, "--no-progress"]
    short = ["--max-steps", "100", "--checkpoint-every-steps", "50"]
    run = _console_script(
        *_command(commands, "run"), *ours, *short, cwd=tmp_path, api_url=prefect_server
    )
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])  # (the README's --json)
    assert summary["job"] == "exp-1" and summary["final_step"] == 100, summary
    assert summary["eval"]["accuracy"] > 0.8, summary  # (points labelled by their sum's sign)
    assert summary["exports"]["final"] == [100], summary  # (its serve function exported)

    status = _console_script(
        *_command(commands, "status"),
        "--storage",
        str(storage),
        cwd=tmp_path,
        api_url=prefect_server,
    )
    assert status.returncode == 0, status.stderr[-4000:]
    report = json.loads(status.stdout)
    assert report["committed_steps"] == [50, 100] and report["evaluated_steps"] == {
        "eval": [50, 100]
    }


def test_the_readmes_python_call_trains_the_digits_job(tmp_path, prefect_server, monkeypatch):
    from prefect_jax.training.storage import JobStorage

    code = _readme_block("python", "from prefect_jax.flows import train_and_evaluate")
    assert code.count('"/tmp/runs"') == 1, code
    code = code.replace('"/tmp/runs"', repr(str(tmp_path / "runs")))
    monkeypatch.chdir(tmp_path)  # (MLflow's records where the call makes them by default)
    exec(compile(code, str(README), "exec"), {})
    storage = JobStorage(str(tmp_path / "runs"), "digits")
    record = storage.read_json(f"{storage.job_dir}/evals/eval/1000.json")
    assert record["metrics"]["accuracy"] > 0.9, record
