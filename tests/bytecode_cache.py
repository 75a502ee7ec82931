"""Bytecode caching for the test suite's own processes.

Some machines set ``PYTHONDONTWRITEBYTECODE=1``; then every process compiles each module it
imports from source, every time (MLflow's alone is slow to compile). The test suite is the
project's own process: `conftest` calls `write_bytecode()` first, so the first process writes
the ``.pyc`` files and the processes it starts load them. The package itself never overrides
the user's setting.
"""

from __future__ import annotations

import os
import sys


def write_bytecode(children: bool = True) -> None:
    """Let this process (and, with `children`, the processes it starts) write ``.pyc`` files."""
    sys.dont_write_bytecode = False
    if children:
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
