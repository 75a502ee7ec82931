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
from prefect_jax.flows.evaluate import evaluate
from prefect_jax.flows.export import export_flow
from prefect_jax.flows.processes import run_as_process
from prefect_jax.flows.train import train
from prefect_jax.flows.train_and_evaluate import train_and_evaluate

__all__ = ["evaluate", "export_flow", "run_as_process", "train", "train_and_evaluate"]
