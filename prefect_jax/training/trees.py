"""Train states as pytrees: paths, shapes and dtypes, the savable form of PRNG keys,
fingerprints."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

from prefect_jax.training.digests import device_digestible, device_digests, host_digest


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_paths(tree) -> list[tuple[str, Any]]:
    """(``a/b/0``-style path, leaf) pairs in a stable order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [("/".join(_key_name(k) for k in path), leaf) for path, leaf in flat]


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_savable(tree):
    """Typed PRNG keys become their raw uint32 data, which Orbax can store."""
    return jax.tree_util.tree_map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def abstract_savable(abstract):
    def savable(x):
        if not _is_key(x):
            return x
        raw = jax.eval_shape(jax.random.key_data, x)
        return jax.ShapeDtypeStruct(raw.shape, raw.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree_util.tree_map(savable, abstract)


def from_savable(tree, abstract):
    """Inverse of `to_savable`, using the abstract tree to know which leaves were keys."""
    return jax.tree_util.tree_map(
        lambda x, a: jax.random.wrap_key_data(x, impl=a.dtype._impl) if _is_key(a) else x,
        tree,
        abstract,
    )


def describe_tree(tree) -> dict[str, list]:
    """``{path: [shape, dtype]}`` of a (savable) tree, stored with each checkpoint."""
    return {p: [list(np.shape(leaf)), str(leaf.dtype)] for p, leaf in leaf_paths(tree)}


def tree_differences(
    saved: dict[str, list],
    expected: dict[str, list],
    names: tuple[str, str] = ("checkpoint", "init"),
) -> list[str]:
    """Human-readable differences between two `describe_tree` results, `names` saying whose
    (`saved`'s, `expected`'s)."""
    (a, b), diffs = names, []
    for path in sorted(set(saved) | set(expected)):
        if path not in expected:
            diffs.append(f"{path}: in the {a}, not in {b}'s state")
        elif path not in saved:
            diffs.append(f"{path}: in {b}'s state, missing from the {a}")
        elif saved[path] != expected[path]:
            (s_shape, s_dtype), (e_shape, e_dtype) = saved[path], expected[path]
            diffs.append(f"{path}: {a} {s_dtype}{s_shape}, {b} {e_dtype}{e_shape}")
    return diffs


DEVICE_DIGEST_MIN_BYTES = 4 << 20
"""Arrays this large on an accelerator are digested there; the rest on the host. Either way the
digest is the same (`digests`): where it is computed is a matter of cost."""


def _digest_on_device(leaf) -> bool:
    """A large array on a GPU or TPU: read where it is (a copy to the host costs more than the
    digest there). Small ones are not worth a compile, and on a CPU the host's numpy is as fast
    as a jitted digest, without the compile."""
    return (
        device_digestible(leaf)
        and leaf.nbytes >= DEVICE_DIGEST_MIN_BYTES
        and all(d.platform != "cpu" for d in leaf.sharding.device_set)
    )


def device_digest_types(state) -> list[jax.ShapeDtypeStruct]:
    """The types (shape, dtype, sharding) of the leaves `state_fingerprint(state)` digests where
    they are: what `digests.precompile_digests` compiles for ahead of the fingerprint. Not PRNG
    keys: their raw data is small, and reading it would compile a program on the training thread."""
    return [
        own_type(leaf)
        for _, leaf in leaf_paths(state)
        if not _is_key(leaf) and _digest_on_device(leaf)
    ]


def own_type(leaf: jax.Array) -> jax.ShapeDtypeStruct:
    """An array's type as jit looks its program up: shape, dtype, its sharding where it is
    committed (an uncommitted array's program is another) and its weak type (another too). What
    a program compiled ahead from it must be given, so that the real call finds it."""
    return jax.ShapeDtypeStruct(
        leaf.shape,
        leaf.dtype,
        sharding=leaf.sharding if leaf.committed else None,
        weak_type=leaf.weak_type,
    )


def state_fingerprint(state) -> str:
    """SHA-256 over a train state's leaves: each one's path, dtype, shape and a digest of its
    bits (`prefect_jax.training.digests`; the large arrays on an accelerator digested there,
    not copied to the host). Equal states, equal fingerprints, wherever and however sharded
    they are."""
    leaves = leaf_paths(to_savable(state))
    large = [i for i, (_, leaf) in enumerate(leaves) if _digest_on_device(leaf)]
    digests = dict(zip(large, device_digests([leaves[i][1] for i in large]), strict=True))
    for i, (_, leaf) in enumerate(leaves):
        if i not in digests:
            digests[i] = host_digest(jax.device_get(leaf))
    return fingerprint_of(leaves, digests)


def fingerprint_of(leaves: list[tuple[str, Any]], digests: dict[int, bytes]) -> str:
    """SHA-256 over each leaf's path, dtype, shape and digest (`digests[i]` of ``leaves[i]``)."""
    h = hashlib.sha256()
    for i, (path, leaf) in enumerate(leaves):
        h.update(path.encode())
        h.update(str(np.dtype(leaf.dtype)).encode())
        h.update(str(tuple(np.shape(leaf))).encode())
        h.update(digests[i])
    return h.hexdigest()
