"""prefect-jax: train JAX models reliably on Prefect.

`train_and_evaluate` as Prefect flows and tasks, Orbax checkpoints with exact resume,
Grain input pipelines, MLflow records. Importing this package is cheap: it imports
neither jax nor prefect; reach for the parts you need:

- `prefect_jax.flows`: `train_and_evaluate`, and the roles `train`, `evaluate`, `export_flow`.
- `prefect_jax.tasks`: `restore_or_init`, `recover`, `train_until_checkpoint`, `evaluate_if_new`,
  `export`.
- `prefect_jax.training`: the engine, usable without Prefect.
- `prefect_jax.blocks`: where checkpoints live, where MLflow records go.
"""

__version__ = "0.1.0"
