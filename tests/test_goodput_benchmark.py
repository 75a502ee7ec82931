"""`benchmarks/goodput.py`, the harness behind issue 52's item 4 (goodput of the byte LM under
preemption, prefect-jax against the plain JAX loop), in one small cell: each system's job is
SIGKILLed every T seconds and rerun at once until it ends. Every system must end at the job's last
step after more than one attempt (so the kills landed and the reruns resumed), and the result must
hold what BENCHMARKS.md renders: each run's goodput and the prefect-jax ledger's breakdown. Keras
is not a system here: the `bench` group that brings it is not in the test environment."""

import json
import os
import subprocess
import sys

import pytest
from process_helpers import BENCHMARKS_DIR

SCRIPT = os.path.join(BENCHMARKS_DIR, "goodput.py")
PERIOD = 10.0


@pytest.mark.slow
def test_a_killed_lm_job_ends_at_its_last_step_on_every_system_with_its_goodput(tmp_path):
    out = tmp_path / "goodput.json"
    done = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--model",
            "lm",
            "--systems",
            "prefect_jax,plain",
            "--periods",
            str(PERIOD),
            "--signals",
            "KILL",
            "--lm-params",
            json.dumps({"batch_size": 1, "eval_sequences": 8, "max_files": 400}),
            "--steps",
            "100",  # about 2 T here
            "--every",
            "10",
            "--min-periods",
            "1.6",  # the harness raises --steps until each uninterrupted job outlasts 1.6 T
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert steps % 10 == 0 and steps >= 100
    for system, run in report["uninterrupted"].items():
        assert run["attempts"] == 1 and run["final_step"] == steps, (system, run)
        assert run["total_s"] >= PERIOD, (system, run)
    runs = {r["system"]: r for r in report["runs"]}
    assert sorted(runs) == ["plain", "prefect_jax"]
    for run in runs.values():
        assert run["period_s"] == PERIOD and run["signal"] == "KILL"
        assert "failed" not in run, run
        assert run["final_step"] == steps, run
        assert run["attempts"] >= 2 and run["exits"][-1] == 0, run  # killed, then resumed
        assert 0 < run["goodput"] <= 1.5 and run["vs_plain"] > 0, run
    ledger = runs["prefect_jax"]["breakdown"]
    assert ledger["source"] == "ledger" and 0 < ledger["goodput_ledger"] <= 1
    # An attempt opens its record once its restore ends (`GoodputLedger.begin`): one killed
    # before that (a start-up past T on a loaded machine) leaves none.
    recorded = len(ledger["restored_steps"])
    assert 2 <= recorded <= runs["prefect_jax"]["attempts"], ledger
    assert len(ledger["restart_s"]) == recorded - 1, ledger
    marks = runs["plain"]["breakdown"]
    assert marks["source"] == "marks" and marks["restored_steps"], marks
