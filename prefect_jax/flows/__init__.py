"""Prefect flows: `train_and_evaluate` (TF's local mode), and the roles it splits into:
`train` (the trainer), `evaluate` (the continuous evaluator) and `export`.

Every parameter is JSON-able (a program import path, names, a URL and pydantic specs), so
the flow deploys as is: ``prefect deploy`` or ``train_and_evaluate.serve(...)``. Deployments
name them by this file (``prefect_jax/flows/__init__.py:train``), which Prefect loads as a
module of its own: the imports here are absolute.

Example:
    ```python
    from prefect_jax.flows import train_and_evaluate
    from prefect_jax.training.specs import CheckpointSpec, EvalSpec, TrainSpec

    summary = train_and_evaluate(
        program="prefect_jax.examples.digits:program",
        job="digits",
        storage="/tmp/prefect-jax",
        train_spec=TrainSpec(max_steps=1000),
        checkpoint_spec=CheckpointSpec(every_steps=200),
        eval_spec=EvalSpec(),
    )
    print(summary["eval"])
    ```
"""

# No `from __future__ import annotations` (nor in any module of this package): `serve` sends a
# flow to its child process with cloudpickle, which copies only the globals the function's code
# uses; string annotations would leave TrainSpec & co. unresolvable there and every served run
# would fail parameter validation (tests/test_deployment_rerun.py).
import importlib

# Each flow is imported when it is first asked for: Prefect's ``@flow`` builds the JSON schema of
# every parameter as it decorates, a few tenths of a second per flow on two cores, paid at every
# start of a process that runs one flow (a command, a rerun after preemption, a deployment's
# run). The modules live in `roles/`: a module named as its flow (``flows/train.py``) would
# shadow the flow, as importing a submodule sets the package attribute of its name.
_WHERE = {
    "evaluate": "prefect_jax.flows.roles.evaluate",
    "export_flow": "prefect_jax.flows.roles.export",
    "run_as_process": "prefect_jax.flows.processes",
    "train": "prefect_jax.flows.roles.train",
    "train_and_evaluate": "prefect_jax.flows.roles.train_and_evaluate",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:  # (then ``from prefect_jax.flows import loop`` finds the submodule)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
