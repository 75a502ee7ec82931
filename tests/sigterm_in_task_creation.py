"""`prefect-jax` with a SIGTERM delivered inside Prefect's creation of the first `export` task
run (after its crash handling is armed, before the task run exists): the moment at which
Prefect 3.8's own crash handling fails with "Task run is not set".

usage: python sigterm_in_task_creation.py <prefect-jax arguments>
"""

from __future__ import annotations

import os
import signal
import sys

from prefect import task_engine

_create = task_engine._create_task_run_locally
_sent = []


def _create_with_sigterm(*args, **kwargs):
    task = kwargs.get("task", args[0] if args else None)
    if getattr(task, "name", None) == "export" and not _sent:
        _sent.append(True)
        os.kill(os.getpid(), signal.SIGTERM)
    return _create(*args, **kwargs)


task_engine._create_task_run_locally = _create_with_sigterm

if __name__ == "__main__":
    from prefect_jax.cli import main

    sys.exit(main(sys.argv[1:]))
