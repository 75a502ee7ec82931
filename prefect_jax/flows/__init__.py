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
# would fail parameter validation (tests/test_deployment_rerun.py; tests/test_flows_parameters.py
# checks every module of the package).
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (for type checkers and editors; at run time `__getattr__` imports them)
    from prefect_jax.flows.processes import run_as_process
    from prefect_jax.flows.roles.evaluate import evaluate
    from prefect_jax.flows.roles.export import export_flow
    from prefect_jax.flows.roles.train import train
    from prefect_jax.flows.roles.train_and_evaluate import train_and_evaluate

# Each flow is imported when it is first asked for: Prefect's ``@flow`` builds the JSON schema of
# every parameter as it decorates, paid at every start of a process that runs one flow (a
# command, a rerun after preemption, a deployment's run; BENCHMARKS.md: Restart). The modules
# live in `roles/`: a module named as its flow (``flows/train.py``) would shadow the flow, as
# importing a submodule sets the package attribute of its name.
_WHERE = {
    "evaluate": "prefect_jax.flows.roles.evaluate",
    "export_flow": "prefect_jax.flows.roles.export",
    "run_as_process": "prefect_jax.flows.processes",
    "train": "prefect_jax.flows.roles.train",
    "train_and_evaluate": "prefect_jax.flows.roles.train_and_evaluate",
}

__all__ = ["evaluate", "export_flow", "run_as_process", "train", "train_and_evaluate"]


def __getattr__(name: str):
    if name not in _WHERE:  # (then ``from prefect_jax.flows import task_loop`` finds the submodule)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(_WHERE[name])
    except AttributeError as exc:
        # (else ``from prefect_jax.flows import train`` and Prefect's entrypoint loader would
        # both swallow it, and say only that the flow is not there)
        raise ImportError(f"importing {_WHERE[name]}: {exc!r}") from exc
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
