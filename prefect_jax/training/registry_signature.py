"""The MLflow signature and input example of an export (``jax.export``): its inputs and outputs
as tensors, from the export's avals, symbolic dimensions as -1, named inputs by their keys."""

from __future__ import annotations

import logging

logger = logging.getLogger("prefect_jax.registry")


def _serving_inputs(exported):
    """The export's serving input as called: one aval, or a dict ``{name: aval}``."""
    import jax

    args, _ = jax.tree_util.tree_unflatten(exported.in_tree, exported.in_avals)
    return args[0]


def typed_example(exported, example):
    """`example` (an array, or a dict of arrays for named inputs) as the export's dtypes, cut
    where it breaks a constraint of a symbolic dimension (``s <= 32``, say: an example taken from
    an eval batch of ``seq_len + 1`` tokens); None where no cut fits (no example is logged)."""
    import numpy as np

    inputs = _serving_inputs(exported)
    if isinstance(inputs, dict):
        typed = {k: np.asarray(example[k], dtype=a.dtype) for k, a in inputs.items()}
    else:
        typed = np.asarray(example, dtype=inputs.dtype)
    return _within_constraints(exported, inputs, typed)


def _fits(exported, example) -> bool:
    import jax

    try:
        jax.eval_shape(exported.call, example)  # shapes checked against the constraints only
        return True
    except ValueError:
        return False


def _within_constraints(exported, inputs, example):
    """`example` if the export takes it; else the first cut of its symbolic dimensions it takes:
    one dimension at a time, then all together, each to sizes below its own (one less, then
    powers of two)."""
    import jax

    if _fits(exported, example):
        return example
    avals, arrays = jax.tree.leaves(inputs), jax.tree.leaves(example)
    axes = [
        (i, ax)
        for i, aval in enumerate(avals)
        for ax, d in enumerate(aval.shape)
        if not isinstance(d, int) and arrays[i].shape[ax] > 1
    ]

    def cut(sizes: dict):
        leaves = [
            a[tuple(slice(0, sizes.get((i, ax))) for ax in range(a.ndim))]
            for i, a in enumerate(arrays)
        ]
        return jax.tree.unflatten(jax.tree.structure(example), leaves)

    def below(n: int) -> list[int]:
        return sorted({n - 1} | {2**k for k in range(n.bit_length()) if 2**k < n}, reverse=True)

    longest = max((arrays[i].shape[ax] for i, ax in axes), default=1)
    tries = [{(i, ax): size} for i, ax in axes for size in below(arrays[i].shape[ax])]
    tries += [{key: size for key in axes} for size in below(longest)]
    for sizes in tries:
        candidate = cut(sizes)
        if _fits(exported, candidate):
            return candidate
    logger.warning(
        "no input example for the MLflow model: %s breaks a constraint of the serving input's "
        "symbolic dimensions, and no cut of them fits (give the program a serving_example())",
        jax.tree.map(lambda a: a.shape, example),
    )
    return None


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
