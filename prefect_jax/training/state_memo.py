"""Values computed from one train state, found again when the very same state is asked about.

A job's end asks two things of its final state: its fingerprint (`Loop.fingerprint`) and its
evaluation (`Loop.evaluate`). Both are pure functions of the state's values, and both can be
computed while the final checkpoint commits, when the training thread would otherwise only wait
(`Intervals.save`). `StateMemo` keeps them for the state they were computed from: the same
`jax.Array` objects in the same tree. JAX arrays are immutable, so the same objects hold the same
values (a `device_put` that moves nothing returns them as they are); a step or a restore makes
new ones, and the memo starts over. It holds weak references only, so it never keeps a state (a
device's memory) alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import jax

T = TypeVar("T")


class StateMemo:
    """Values of the one state last asked about, by key (see the module's docstring)."""

    def __init__(self) -> None:
        self._treedef = None
        self._leaves: list[weakref.ref] = []
        self._values: dict[Hashable, Any] = {}

    def get(self, state, key: Hashable, compute: Callable[[], T]) -> T:
        """`compute()`'s value for `state`, computed once while `state` is the state asked about.
        A state with no leaves, or with a leaf that is not a `jax.Array` (a NumPy array can be
        changed in place), is computed every time."""
        leaves, treedef = jax.tree.flatten(state)
        if not leaves or not all(isinstance(x, jax.Array) for x in leaves):
            return compute()
        if not self._is(leaves, treedef):
            self._treedef, self._values = treedef, {}
            self._leaves = [weakref.ref(x) for x in leaves]
        if key not in self._values:
            self._values[key] = compute()
        return self._values[key]

    def take(self, state, key: Hashable, compute: Callable[[], T]) -> T:
        """The value `get` computed ahead for `state`, once (it is dropped); else `compute()`. For
        what a caller means to compute afresh each time it asks, as an evaluation."""
        leaves, treedef = jax.tree.flatten(state)
        if leaves and self._is(leaves, treedef) and key in self._values:
            return self._values.pop(key)
        return compute()

    def _is(self, leaves: list, treedef) -> bool:
        return (
            self._treedef is not None
            and treedef == self._treedef
            and len(leaves) == len(self._leaves)
            and all(ref() is x for ref, x in zip(self._leaves, leaves, strict=True))
        )


__all__ = ["StateMemo"]
