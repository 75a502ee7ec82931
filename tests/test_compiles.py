"""The train step compiles once per process: the compile done ahead of time (overlapping the
restore) is the one the loop finds, from the first step to the last; with a warm persistent
compilation cache a rerun compiles nothing. Each run is a fresh process, as a rerun is."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from process_helpers import TESTS_DIR

pytestmark = pytest.mark.slow


def _run(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "count_compiles.py", *args], capture_output=True, text=True, cwd=TESTS_DIR, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_train_step_compiles_once_per_run_and_not_at_all_from_a_warm_cache(tmp_path, mlflow_uri):
    first = _run(str(tmp_path / "a"), mlflow_uri)
    assert (first["start"], first["end"], first["compiled"]) == (0, 40, 1)
    rerun = _run(str(tmp_path / "a"), mlflow_uri)
    assert (rerun["start"], rerun["end"], rerun["compiled"]) == (40, 80, 1)

    cache = str(tmp_path / "compile-cache")
    cold = _run(str(tmp_path / "b"), mlflow_uri, cache)
    assert cold["cache_miss"] == 1 and cold["cache_hit"] == 0
    warm = _run(str(tmp_path / "b"), mlflow_uri, cache)
    assert warm["start"] == 40 and warm["cache_miss"] == 0 and warm["cache_hit"] >= 1
