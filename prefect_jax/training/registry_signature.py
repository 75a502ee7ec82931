"""The MLflow signature and input example of an export (``jax.export``): its inputs and outputs
as tensors, from the export's avals, symbolic dimensions as -1, named inputs by their keys."""

from __future__ import annotations


def _serving_inputs(exported):
    """The export's serving input as called: one aval, or a dict ``{name: aval}``."""
    import jax

    args, _ = jax.tree_util.tree_unflatten(exported.in_tree, exported.in_avals)
    return args[0]


def typed_example(exported, example):
    """`example` (an array, or a dict of arrays for named inputs) as the export's dtypes."""
    import numpy as np

    inputs = _serving_inputs(exported)
    if isinstance(inputs, dict):
        return {k: np.asarray(example[k], dtype=a.dtype) for k, a in inputs.items()}
    return np.asarray(example, dtype=inputs.dtype)


def _tensor_specs(tree):
    """MLflow TensorSpecs of a pytree of avals: a symbolic dimension is -1 (any size); the
    leaves of a dict named by their keys (one array: unnamed)."""
    import jax
    import numpy as np
    from mlflow.types import Schema, TensorSpec

    def spec(aval, name=None):
        shape = tuple(d if isinstance(d, int) else -1 for d in aval.shape)
        return TensorSpec(np.dtype(aval.dtype), shape, name)

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if len(leaves) == 1 and not leaves[0][0]:
        return Schema([spec(leaves[0][1])])
    return Schema(
        [spec(a, jax.tree_util.keystr(path, simple=True, separator=".")) for path, a in leaves]
    )


def export_signature(exported, example=None):
    """The MLflow signature of a ``jax.export``: its inputs and outputs as tensors, from the
    export's avals (no compile), symbolic dimensions -1. Outputs in a tuple or list are what the
    pyfunc predicts, NumPy's stack of them: their spec is traced on `example` (an input example)."""
    import jax
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    outputs = jax.tree_util.tree_unflatten(exported.out_tree, exported.out_avals)
    if isinstance(outputs, (tuple, list)) and example is not None:
        out = jax.eval_shape(exported.call, example)
        stacked = np.asarray(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), out))
        out_schema = Schema([TensorSpec(stacked.dtype, (-1, *stacked.shape[1:]))])
    else:
        out_schema = _tensor_specs(outputs)
    return ModelSignature(inputs=_tensor_specs(_serving_inputs(exported)), outputs=out_schema)
