"""A training process's start-up and Python's garbage collector.

A process that trains imports Prefect, JAX, Orbax, Grain and the program: over a million objects
that live as long as the process. Two costs follow, both paid on the training thread:

- during the imports, the collector's passes walk the growing heap again and again (~0.4 s of a
  2 s start-up on 2 CPUs, measured 2026-11-25 on the command);
- afterwards, every full collection walks them all again (pauses of ~0.1-0.3 s, ~1.3 s over a
  40 s run on 2 CPUs).

So a process that exists for one job keeps the collector off through its start-up, then moves
what the start-up made out of the collector's reach (`gc.freeze`) and turns it back on: objects
made later are collected as usual. The `prefect-jax` command does this for itself
(`prefect_jax.cli`). A flow run in a process that Prefect started for it (`runs_one_flow_run`:
``python -m prefect.engine``, which process workers and ``prefect flow-run execute`` start, or
Prefect's in-process bootstrap of ``prefect.flow_engine``), and a process 1+ of a
multi-process job (``prefect-jax process``, `claim_process`), do it while they make their first
trainer (JAX's, Orbax's, Grain's and the program's imports, the trainer's set-up;
`prefect_jax.training.live.get_trainer`): `collector_off_for_startup` and `end_startup`. Not
longer: an evaluator may wait hours for a first checkpoint before it makes its trainer, and
garbage made with the collector off would pile up. Anywhere else (a flow called from a user's own
Python process, `flow.serve()` running a flow it holds in memory, a test) the collector is left
alone: freezing there would keep garbage cycles of that process's earlier work for good.

This module imports neither jax nor prefect.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

LONG_STARTUP_SECS = 10.0  # a start-up window longer than this (a cluster's join, a cache's download) is collected before its freeze

_lock = threading.Lock()
_window: tuple[int, bool, float] | None = None  # (the thread that turned the collector off, was it on, when)
_frozen = False  # this process froze its start-up objects (once per process)
_claimed = False  # `claim_process`: this process exists for one flow run


def claim_process() -> None:
    """This process exists to run one flow run (``prefect-jax process``, a multi-process job's
    process 1+): its first trainer is made as in a process Prefect started (`runs_one_flow_run`)."""
    global _claimed
    _claimed = True


def runs_one_flow_run(argv: list[str] | None = None) -> bool:
    """Whether this process exists to run one flow run: ``python -m prefect.engine`` (process
    workers' flow runs, which ``prefect flow-run execute`` starts too), ``python -m
    prefect.flow_engine`` or Prefect's in-process bootstrap of either (its ``sys.argv`` names the
    module), ``prefect flow-run execute`` itself, or a process that `claim_process` claimed."""
    if argv is None:
        if _claimed:
            return True
        argv = sys.argv
    if not argv:
        return False
    first = argv[0].replace("\\", "/")
    if first in ("prefect.engine", "prefect.flow_engine") or first.endswith(("/prefect/engine.py", "/prefect/flow_engine.py")):
        return True
    return os.path.basename(first) in ("prefect", "prefect.exe") and argv[1:3] == ["flow-run", "execute"]


def collector_off_for_startup() -> None:
    """Before the first trainer is made, in a process that runs one flow run (`runs_one_flow_run`)
    and has not frozen its start-up yet: turn the collector off until this thread's `end_startup`.
    Another thread making a trainer meanwhile leaves the window to the first."""
    global _window
    with _lock:
        if _frozen or _window is not None or not runs_one_flow_run():
            return
        _window = (threading.get_ident(), gc.isenabled(), time.monotonic())
        gc.disable()


def end_startup(failed: bool = False) -> None:
    """The trainer this thread made after `collector_off_for_startup` is made: freeze what the
    start-up made and turn the collector back on (unless it was off before); or, with `failed`
    (making it raised), turn the collector back on without freezing (a retry may still freeze).
    Nothing if this thread opened no window."""
    global _window
    with _lock:
        if _window is None or _window[0] != threading.get_ident():
            return
        _, was_on, since = _window
        _window = None
        if failed:
            if was_on:
                gc.enable()
            return
        if time.monotonic() - since > LONG_STARTUP_SECS:
            gc.collect()  # garbage a long wait made (fsspec, Prefect's threads) is not kept for good
        freeze_startup_objects(enable=was_on)


def freeze_startup_objects(enable: bool = True) -> None:
    """Move every object the process has made so far out of the garbage collector's reach
    (`gc.freeze`), and turn the collector on (with `enable`). The cyclic garbage the imports leave
    (~13,000 objects, ~4 MB, 2026-11-25) is frozen with the rest: collecting it first would cost
    ~0.18 s. MLflow, where it is imported in this process (no worker process), freezes its
    objects the same way once it is open (`prefect_jax.training.tracking.Tracker`)."""
    global _frozen
    from prefect_jax.training import tracking

    gc.freeze()
    _frozen = True
    if enable:
        gc.enable()
    tracking.freeze_after_connect = True
