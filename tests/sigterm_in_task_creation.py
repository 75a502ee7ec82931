"""`prefect-jax` with a SIGTERM delivered inside Prefect's creation of the first `export` task
run (after its crash handling is armed, before the task run exists): the moment at which
Prefect 3.8's own crash handling fails with "Task run is not set". With ``CANCEL_FIRST=1`` in
the environment, the flow run is set Cancelling first, as the UI's Cancel button does.

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
        if os.environ.get("CANCEL_FIRST"):  # as the UI's Cancel: Cancelling, then the signal
            _cancel_this_flow_run()
        os.kill(os.getpid(), signal.SIGTERM)
    return _create(*args, **kwargs)


def _cancel_this_flow_run() -> None:
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run.id, Cancelling(), force=True)


task_engine._create_task_run_locally = _create_with_sigterm

if __name__ == "__main__":
    from prefect_jax.cli import main

    sys.exit(main(sys.argv[1:]))
