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
(`prefect_jax.cli`). A flow run that Prefect started in a process of its own (a worker's or a
runner's ``python -m prefect.engine``, or ``prefect flow-run execute``) does it while it makes
its first trainer (JAX's, Orbax's, Grain's and the program's imports, the trainer's set-up;
`prefect_jax.training.live.get_trainer`): `collector_off_for_startup` and `end_startup`. Not
longer: an evaluator may wait hours for a first checkpoint before it makes its trainer, and
garbage made with the collector off would pile up. Anywhere else (a flow called from a user's
own Python process, a test) the collector is left alone: freezing there would keep garbage
cycles of that process's earlier work for good.

This module imports neither jax nor prefect.
"""

from __future__ import annotations

import gc
import os
import sys

_collector_was_on: bool | None = None  # set while this module holds the collector off (`collector_off_for_startup`)
_frozen = False  # this process froze its start-up objects (once per process)


def runs_one_flow_run(argv: list[str] | None = None) -> bool:
    """Whether this process was started by Prefect to run one flow run: ``python -m
    prefect.engine`` (process workers, `serve` and other runners; Prefect's own in-process
    bootstrap names it ``prefect.engine``) or ``prefect flow-run execute`` (other workers' default
    command)."""
    argv = sys.argv if argv is None else argv
    if not argv:
        return False
    first = argv[0].replace("\\", "/")
    if first == "prefect.engine" or first.endswith("/prefect/engine.py"):
        return True
    return os.path.basename(first) in ("prefect", "prefect.exe") and argv[1:3] == ["flow-run", "execute"]


def collector_off_for_startup() -> None:
    """Before the first trainer is made, in a process that runs one flow run (`runs_one_flow_run`)
    and has not frozen its start-up yet: turn the collector off until `end_startup`."""
    global _collector_was_on
    if _frozen or _collector_was_on is not None or not runs_one_flow_run():
        return
    _collector_was_on = gc.isenabled()
    gc.disable()


def end_startup() -> None:
    """The start-up is over (the first trainer is made, or its making failed): if
    `collector_off_for_startup` turned the collector off, freeze what the start-up made and turn
    the collector back on (unless it was off before). Otherwise nothing."""
    global _collector_was_on
    if _collector_was_on is None:
        return
    was_on, _collector_was_on = _collector_was_on, None
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
