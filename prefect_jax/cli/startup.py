"""The command's own process and Python's garbage collector (fenced: only `prefect_jax.cli`
imports this module).

A ``prefect-jax`` command that trains imports Prefect, JAX, Orbax, Grain and the program: over a
million objects that live as long as the process. While those imports run, the collector's
passes walk the growing heap again and again; afterwards, every full collection walks it all
again, on the training thread. So the command, which starts and owns its process, keeps the
collector off through its start-up (`collector_off`), then moves what the start-up made out of
the collector's reach (`gc.freeze`) and turns it back on (`freeze_startup_objects`): objects
made later are collected as usual. ``prefect-jax process`` does the same for its own process.

Nothing else in the package touches the collector of a process it did not start: a flow run in
a process Prefect started, a user's script or notebook, a test, keep the interpreter as they
set it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """The collector off through the block, until `freeze_startup_objects` turns it on; at the
    block's end (a command refused or failed before its freeze) it is on again if it was on
    before, and a caller's choice is otherwise kept."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def freeze_startup_objects() -> None:
    """Move every object the process has made so far out of the collector's reach (`gc.freeze`)
    and turn the collector on. The cyclic garbage the imports left is frozen with the rest:
    collecting it first would cost more than it frees. MLflow, where it is imported in this
    process (no MLflow worker process), has its objects frozen the same way once it is open."""
    from prefect_jax.training import tracking

    gc.freeze()
    gc.enable()
    tracking.freeze_mlflow_once_connected()
