"""`benchmarks/first_step.py`, which docs/performance.md tells users to run on their own program
before they set an XLA flag: it runs a program's step in fresh processes per setting and prints
one row per setting; a malformed param is refused before any process starts."""

import os
import re
import subprocess
import sys

from process_helpers import BENCHMARKS_DIR

SCRIPT = os.path.join(BENCHMARKS_DIR, "first_step.py")


def first_step(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300
    )


def test_a_row_per_setting_with_each_processs_first_and_later_runs():
    done = first_step(
        "--program",
        "prefect_jax.examples.digits:tiny",
        "--runs",
        "1",
        "--steps",
        "3",
        "--flags",
        "",
        "--flags=--xla_cpu_experimental_ynn_fusion_type=",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [
        "(defaults)",
        "--xla_cpu_experimental_ynn_fusion_type=",
    ]
    number = r" \d+\.\d\d "
    for row in rows:  # first run, its CPU, later runs, their CPU, the load: one process each
        assert re.fullmatch(r"\| `[^`]*` \|" + rf"({number}\|)" * 5, row), row


def test_a_malformed_program_param_is_refused_before_any_process():
    done = first_step("--program", "prefect_jax.examples.digits:tiny", "--program-param", "width")
    assert done.returncode == 2
    assert "--program-param 'width' is not KEY=VALUE" in done.stderr
    assert done.stdout == ""
