"""Where a program's state and batches live on the devices: its mesh, the shardings it declares,
the ready FSDP rule, and the checks that refuse bad ones before any compute.

A program that declares nothing keeps the engine's default placement (`prefect_jax.training.loop`):
one device, or data parallel with a replicated state over several processes. A program that sets
``mesh_axes`` and/or ``shardings`` (see `prefect_jax.training.program`) gets a named mesh over every
device, the state placed as ``shardings(abstract_state, mesh)`` says, and the batches split along
their leading axis over the data axes (``batch_spec``).

Example:
    ```python
    from prefect_jax.training import sharding

    class Program:
        mesh_axes = {"data": -1}                    # every device on one axis
        def shardings(self, abstract_state, mesh):  # FSDP: each large array split 8 ways
            return sharding.fsdp(abstract_state, mesh, axis="data")
    ```
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from prefect_jax.training.trees import leaf_paths

__all__ = [
    "DATA_AXES",
    "ShardingError",
    "batch_sharding",
    "build_mesh",
    "by_path",
    "check_batch",
    "declares_sharding",
    "fsdp",
    "init_with_mesh",
    "replicas",
    "spec_axes",
    "state_shardings",
    "under_mesh",
]

# The mesh axes a batch's leading axis is split over by default: data parallel and FSDP.
DATA_AXES = ("data", "fsdp")

# FSDP leaves arrays smaller than this (elements) replicated: splitting a bias or a norm's scale
# saves no memory and adds a gather per use.
FSDP_MIN_SIZE = 1024


class ShardingError(ValueError):
    """A mesh or sharding that cannot be built on these devices: refused before any compute."""


def declares_sharding(program: Any) -> bool:
    """Whether the program declares a mesh (``mesh_axes``) or its state's ``shardings``."""
    return getattr(program, "mesh_axes", None) is not None or callable(
        getattr(program, "shardings", None)
    )


def placement(
    program: Any, devices: Sequence, processes: int
) -> tuple[Mesh, NamedSharding, NamedSharding, NamedSharding] | None:
    """The mesh a loop places the state and the batches on, with its replicated, batch and
    stacked-batches shardings: the program's own (`declares_sharding`, over every device of
    every process), or data parallel over every device of several JAX processes (the state
    replicated, each batch split along its first axis); None for one process of a program that
    declares none (its one device).

    Raises:
        ShardingError: a mesh that does not fit the devices (`build_mesh`; with several
            processes, the devices of all of them) or a batch spec naming an axis it lacks.
    """
    if declares_sharding(program):
        try:
            mesh = build_mesh(getattr(program, "mesh_axes", None), devices)
        except ShardingError as exc:
            if processes == 1:
                raise
            raise ShardingError(
                f"{exc} (the mesh spans the devices of all {processes} JAX processes: "
                f"{len(devices) // processes} in each)"
            ) from None
        batch = batch_sharding(getattr(program, "batch_spec", None), mesh)
    elif processes > 1:
        mesh = Mesh(np.array(devices), ("data",))
        batch = NamedSharding(mesh, PartitionSpec("data"))
    else:
        return None
    stacked = NamedSharding(mesh, PartitionSpec(None, *batch.spec))
    return mesh, NamedSharding(mesh, PartitionSpec()), batch, stacked


def build_mesh(axes: dict[str, int] | None, devices: Sequence | None = None) -> Mesh:
    """A mesh of named axes over `devices` (default: every device of every process).

    Args:
        axes: ``{name: size}`` in mesh order; one size may be ``-1``: the devices the others
            leave (``{"data": -1}``: every device on one axis). None: ``{"data": -1}``.
        devices: the devices, in order (default ``jax.devices()``).

    Raises:
        ShardingError: the sizes do not multiply to the device count, or are malformed.
    """
    axes = {"data": -1} if axes is None else dict(axes)
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    fix = f"give sizes whose product is {n} (the devices), with at most one -1 for the rest"
    if not axes or not all(isinstance(k, str) and k for k in axes):
        raise ShardingError(
            f"the program's mesh_axes={axes!r}: name each axis with a string; {fix}"
        )
    sizes = list(axes.values())
    # (`type(s) is int`: a JSON true, an int to Python, would have been an axis of one device)
    if not all(type(s) is int and (s >= 1 or s == -1) for s in sizes) or sizes.count(-1) > 1:
        raise ShardingError(
            f"the program's mesh_axes={axes!r}: sizes must be ints (not booleans), each positive "
            f"or one -1; {fix}"
        )
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n % known:
            raise ShardingError(
                f"the program's mesh_axes={axes!r}: the fixed sizes multiply to {known}, which "
                f"does not divide the {n} devices; {fix}"
            )
        sizes[sizes.index(-1)] = n // known
    elif known != n:
        raise ShardingError(
            f"the program's mesh_axes={axes!r} multiply to {known}, not the {n} devices; {fix}"
        )
    names = tuple(axes)
    # Auto axes: the compiler propagates shardings between the ones the engine pins (state in and
    # out, batches), and Flax's sharding annotations become sharding constraints.
    return Mesh(np.array(devices).reshape(sizes), names, axis_types=(AxisType.Auto,) * len(names))


def spec_axes(spec: PartitionSpec) -> list[str]:
    """The mesh axes `spec` names, in order (``P(None, ("data", "model"))``: data, model)."""
    out = []
    for entry in spec:
        if entry is None:
            continue
        out.extend(entry if isinstance(entry, tuple) else (entry,))
    return out


def _named(spec, shape, mesh: Mesh, where: str) -> NamedSharding:
    """`spec` (PartitionSpec, NamedSharding or None) as a NamedSharding on `mesh`, checked against
    the array's `shape`."""
    if spec is None:
        spec = PartitionSpec()
    if isinstance(spec, NamedSharding):
        if spec.mesh.shape != mesh.shape or spec.mesh.axis_names != mesh.axis_names:
            raise ShardingError(
                f"{where}: a NamedSharding on mesh {dict(spec.mesh.shape)}, not the program's "
                f"mesh {dict(mesh.shape)}: return a PartitionSpec (or build it on `mesh`)"
            )
        spec = spec.spec
    if not isinstance(spec, PartitionSpec):
        raise ShardingError(
            f"{where}: {spec!r} is not a PartitionSpec, NamedSharding or None: return one per "
            "leaf of the state (e.g. jax.sharding.PartitionSpec('data'))"
        )
    unknown = [a for a in spec_axes(spec) if a not in mesh.shape]
    if unknown:
        raise ShardingError(
            f"{where}: {spec} names axis {unknown[0]!r}, which the mesh {dict(mesh.shape)} lacks: "
            f"use one of {list(mesh.axis_names)} (or add it to mesh_axes)"
        )
    if len(spec) > len(shape):
        raise ShardingError(
            f"{where}: {spec} has {len(spec)} entries for an array of shape {tuple(shape)}: "
            "give at most one entry per dimension"
        )
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        parts = math.prod(mesh.shape[a] for a in names)
        if shape[dim] % parts:
            raise ShardingError(
                f"{where}: {spec} splits dimension {dim} of shape {tuple(shape)} ({shape[dim]}) "
                f"into {parts} parts over {names}, which does not divide it: shard another "
                f"dimension, or make it a multiple of {parts}"
            )
    return NamedSharding(mesh, spec)


def state_shardings(specs, abstract_state, mesh: Mesh):
    """The program's `specs` (a pytree of PartitionSpec / NamedSharding / None matching
    `abstract_state`, or None: replicate everything) as NamedShardings, each checked.

    Raises:
        ShardingError: a spec names an axis the mesh lacks, splits a dimension it does not
            divide, or the tree does not match the state; the message names the leaf.
    """
    paths = [p for p, _ in leaf_paths(abstract_state)]
    leaves, treedef = jax.tree.flatten(abstract_state)
    if specs is None:
        flat = [None] * len(leaves)
    else:
        try:
            flat = treedef.flatten_up_to(specs)
        except (ValueError, TypeError) as exc:
            raise ShardingError(
                f"shardings() returned a tree that does not match the state's ({exc}): return "
                "one PartitionSpec (or None) per leaf, in the state's structure"
            ) from exc
    named, refused = [], []
    for p, s, leaf in zip(paths, flat, leaves, strict=True):
        try:
            named.append(_named(s, leaf.shape, mesh, f"state leaf {p!r}"))
        except ShardingError as exc:
            refused.append((len(p), p, exc))
    if refused:  # the shortest path named: a parameter before its optimizer state's copies
        first = min(refused, key=lambda r: r[:2])[2]
        more = f" (and {len(refused) - 1} more leaves)" if len(refused) > 1 else ""
        raise ShardingError(f"{first}{more}") from None
    return jax.tree.unflatten(treedef, named)


def batch_sharding(spec: PartitionSpec | None, mesh: Mesh) -> NamedSharding:
    """The batches' sharding: `spec` (the program's ``batch_spec``), else the leading axis split
    over the mesh's data axes (`DATA_AXES`) it has."""
    if spec is None:
        axes = tuple(a for a in mesh.axis_names if a in DATA_AXES)
        spec = PartitionSpec(axes if len(axes) > 1 else (axes[0] if axes else None))
    unknown = [a for a in spec_axes(spec) if a not in mesh.shape]
    if unknown:
        raise ShardingError(
            f"batch_spec {spec} names axis {unknown[0]!r}, which the mesh {dict(mesh.shape)} "
            f"lacks: use one of {list(mesh.axis_names)}"
        )
    return NamedSharding(mesh, spec)


def check_batch(
    batch, sharding: NamedSharding, axis: int = 0, what: str = "train batch", fix: str = ""
) -> None:
    """Refuse a batch whose leaves cannot be split as `sharding` says (from dimension `axis` on:
    1 for a scan's stacked batches).

    Raises:
        ShardingError: naming the leaf's shape, the parts and the fix (`fix`, else: make the
            batch size a multiple of the parts).
    """
    mesh, spec = sharding.mesh, sharding.spec
    for path, leaf in leaf_paths(batch):
        shape = np.shape(leaf)[axis:]
        for dim, entry in enumerate(spec):
            if entry is None:
                continue
            names = entry if isinstance(entry, tuple) else (entry,)
            parts = math.prod(mesh.shape[a] for a in names)
            if dim >= len(shape) or shape[dim] % parts:
                raise ShardingError(
                    f"a {what} leaf {path!r} of shape {tuple(shape)} cannot be split into "
                    f"{parts} parts along dimension {dim} (mesh axes {names} of "
                    f"{dict(mesh.shape)}): {fix or f'make the batch size a multiple of {parts}'}"
                )


def check_first_batch(train_data, sharding: NamedSharding, fix: str = "") -> None:
    """`check_batch` on the first train batch, before any compute: read by index from a Grain
    MapDataset (an IterDataset's first batch waits for the loop)."""
    import grain

    if isinstance(train_data, grain.MapDataset):
        check_batch(train_data[0], sharding, fix=fix)


def fsdp(abstract_state, mesh: Mesh, axis: str = "data", min_size: int = FSDP_MIN_SIZE, base=None):
    """Fully sharded data parallel, a pytree of PartitionSpec in the state's structure: each
    array's largest dimension that the `axis` size divides is split over `axis`; arrays under
    `min_size` elements (and scalars) are replicated.

    Args:
        abstract_state: the state's shapes (the engine passes ``jax.eval_shape`` of init).
        mesh: the program's mesh.
        axis: the mesh axis to split over (one the mesh lacks: a ShardingError naming its axes).
        min_size: arrays with fewer elements stay replicated.
        base: specs already chosen (`by_path`'s, over ``model``): FSDP splits a dimension left free.
    """
    if axis not in mesh.shape:
        raise ShardingError(
            f"fsdp(axis={axis!r}): the mesh {dict(mesh.shape)} has no such axis: use one of "
            f"{list(mesh.axis_names)}, or give the mesh a {axis!r} axis"
        )
    size = mesh.shape[axis]
    leaves, treedef = jax.tree.flatten(abstract_state)
    bases = [None] * len(leaves) if base is None else treedef.flatten_up_to(base)

    def spec(leaf, given):
        entries = list(given) if given is not None else []
        shape = tuple(np.shape(leaf))
        entries += [None] * (len(shape) - len(entries))
        if size > 1 and math.prod(shape) >= min_size:
            free = [d for d in range(len(shape)) if entries[d] is None and shape[d] % size == 0]
            if free:
                entries[max(free, key=lambda d: shape[d])] = axis
        return PartitionSpec(*entries)

    return jax.tree.unflatten(treedef, [spec(a, b) for a, b in zip(leaves, bases, strict=True)])


def by_path(abstract_state, rules: Sequence[tuple[str, PartitionSpec]]):
    """A PartitionSpec per leaf from the first rule whose regex matches its ``a/b/0`` path
    (`prefect_jax.training.trees.leaf_paths`; an optimizer's moments carry their parameter's
    path, so they follow it); None (replicated) where no rule matches.

    Example:
        ``by_path(state, [(r"qkv/kernel$", PartitionSpec(None, "model"))])``
    """
    compiled = [(re.compile(r), s) for r, s in rules]
    paths = [path for path, _ in leaf_paths(abstract_state)]
    specs = [next((s for r, s in compiled if r.search(path)), None) for path in paths]
    return jax.tree.unflatten(jax.tree.structure(abstract_state), specs)


def replicas(tree, processes: int):
    """This process's own replica of each array of a replicated `tree` (several processes).

    Raises:
        ValueError: an array is sharded (no process holds all of it).
    """

    def replica(a):
        if not isinstance(a, jax.Array):
            return a
        if not a.sharding.is_fully_replicated:
            raise ValueError(
                f"an array of shape {a.shape} is sharded as {a.sharding}: with {processes} JAX "
                "processes, a process holds a replicated state's replica only; gather a sharded "
                "one with prefect_jax.training.collective.host_gather, in every process"
            )
        return a.addressable_data(0)

    return jax.tree.map(replica, tree)


def process_parts(host_batch, sharding: NamedSharding, axis: int, processes: int):
    """A replicated job's batch (every process reads the same one) as global arrays split along
    `axis` over every device of `sharding`'s mesh, each process giving its own contiguous part,
    so that a job trains the same global batches on any number of processes.

    Raises:
        ValueError: a leaf's `axis` does not divide over the devices (the fix: the batch size).
    """
    devices, index = len(sharding.mesh.devices.flat), jax.process_index()

    def part(x):
        x = np.asarray(x)
        if x.ndim <= axis or x.shape[axis] % devices:
            raise ValueError(
                f"a train batch leaf of shape {x.shape} cannot be split over {devices} "
                f"devices along axis {axis}: make the batch size a multiple of {devices} "
                f"(the devices of all {processes} processes)"
            )
        size = x.shape[axis] // processes
        # A view: no copy before the device's.
        own = (slice(None),) * axis + (slice(index * size, (index + 1) * size),)
        return jax.make_array_from_process_local_data(sharding, x[own])

    return jax.tree.map(part, host_batch)


def under_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """`fn` traced with `mesh` as the abstract mesh in context, so that Flax NNX variables made with
    sharding annotations (``nnx.with_partitioning``) are built as they are, whatever thread
    traces it."""

    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


def init_with_mesh(init: Callable, mesh: Mesh) -> Callable:
    """``init(rng)``, given ``mesh=mesh`` when its signature takes a ``mesh`` argument."""
    try:
        takes = "mesh" in inspect.signature(init).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no mesh argument
        takes = False
    return (lambda rng: init(rng, mesh=mesh)) if takes else init
