"""`prefect-jax` with one SIGTERM delivered inside a garbage-collector callback, where Python
drops whatever exception a handler raises ("Exception ignored in: <function _xla_gc_callback>":
JAX's own gc callback is where the fault sweep's notice was lost).

usage: python sigterm_in_gc_callback.py WHERE <prefect-jax run arguments>

WHERE is when, and how the job runs:

- ``start``: `prefect-jax run`, as the command is about to start its flow run (the command's
  own SIGTERM handler in place);
- ``restore``: the `train_and_evaluate` flow called in this process, as a worker's or `serve`'s
  flow run calls it (no command around it), as its `restore_or_init` task makes the trainer,
  before the trainer's SIGTERM guard exists (Prefect's bridge handles it);
- ``eval``: `prefect-jax run`, at the first evaluation, which runs on the trainer thread: the
  handler, Prefect's bridge, runs on the main thread in the task's wait.
"""

from __future__ import annotations

import gc
import os
import signal
import sys

_sent: list[bool] = []


def sigterm_inside_a_gc_callback() -> None:
    """Collect garbage with a callback that sends this process SIGTERM and runs Python code
    while it is pending, so that the signal's handler runs inside the callback."""

    def callback(phase, info):
        if phase == "start" and not _sent:
            _sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(
                100_000
            ):  # (CPython runs the handler as `os.kill` returns; else at this loop's first check)
                pass

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
    assert _sent


def _at_restore(argv: list[str]) -> None:
    import importlib

    from prefect_jax.training.trainer import Trainer

    # What the trainer would import first (JAX, the program's module) is imported already: a
    # handler's exception raised inside a C extension's import can come out as another error
    # (see the command's), and this case is about how the flow run ends.
    importlib.import_module(argv[argv.index("--program") + 1].split(":")[0])

    init = Trainer.__init__

    def init_after_sigterm(self, *args, **kwargs):
        if not _sent:
            sigterm_inside_a_gc_callback()
        init(self, *args, **kwargs)

    Trainer.__init__ = init_after_sigterm


def _at_start() -> None:
    import prefect_jax.cli.commands

    run_flow = prefect_jax.cli.commands._run_flow

    def run_flow_after_sigterm(*args, **kwargs):
        sigterm_inside_a_gc_callback()
        return run_flow(*args, **kwargs)

    prefect_jax.cli.commands._run_flow = run_flow_after_sigterm


def _run_the_flow(argv: list[str]) -> int:
    """`train_and_evaluate` called here, with what ``prefect-jax run ARGV`` would pass it."""
    from prefect_jax.cli import build_parser
    from prefect_jax.flows import train_and_evaluate
    from prefect_jax.training.specs import CheckpointSpec, TrainSpec

    args = build_parser().parse_args(["run", *argv])
    train_and_evaluate(
        program=args.program,
        job=args.job,
        storage=args.storage,
        mlflow_tracking_uri=args.mlflow_tracking_uri,
        train_spec=TrainSpec(max_steps=args.max_steps),
        checkpoint_spec=CheckpointSpec(every_steps=args.checkpoint_every_steps),
    )
    return 0


def _at_eval() -> None:
    from prefect_jax.training.evaluating import Evaluations

    evaluate = Evaluations._evaluate_if_new

    def evaluate_with_sigterm(self, *args, **kwargs):
        if not _sent:
            sigterm_inside_a_gc_callback()
        return evaluate(self, *args, **kwargs)

    Evaluations._evaluate_if_new = evaluate_with_sigterm


if __name__ == "__main__":
    where, argv = sys.argv[1], sys.argv[2:]
    if where == "restore":
        _at_restore(argv)
        sys.exit(_run_the_flow(argv))
    {"start": _at_start, "eval": _at_eval}[where]()
    from prefect_jax.cli import main

    sys.exit(main(["run", *argv]))
