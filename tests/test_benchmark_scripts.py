"""Every script under benchmarks/ imports. Most of them run only by hand (benchmarks/README.md):
a split that moves or renames a name breaks the scripts that import it, which ruff does not see
across files, and nothing else here would notice until the next person runs one."""

import json
import os
import subprocess
import sys

from process_helpers import BENCHMARKS_DIR

# In a fresh interpreter: the scripts put folders on sys.path and set the bytecode flags at import.
IMPORT_ALL = """
import importlib, json, os, sys
sys.path.insert(0, {folder!r})
failed = {{}}
for name in sorted(f[:-3] for f in os.listdir({folder!r}) if f.endswith(".py")):
    try:
        importlib.import_module(name)
    except BaseException as exc:  # (a script that exits at import is a failure too)
        failed[name] = f"{{type(exc).__name__}}: {{exc}}"
print(json.dumps(failed))
"""


def test_every_benchmark_script_imports():
    names = [f for f in os.listdir(BENCHMARKS_DIR) if f.endswith(".py")]
    assert len(names) > 30, names  # the folder was found, with its scripts
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL.format(folder=BENCHMARKS_DIR)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, f"benchmark scripts that no longer import: {failed}"
