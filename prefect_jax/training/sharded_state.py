"""A sharded program's state as shapes: its init traced under its mesh, each leaf with the sharding
the program declares, checked; and the same checks run by the command before anything starts.

The loop builds its abstract state here (`sharded_abstract_state`); the command's preflight
(`check_sharding`) runs the same on this process's devices, so that a mesh that does not fit, an
annotation or a PartitionSpec naming an axis the mesh lacks, a dimension the axis does not divide
or a batch the data axis does not divide is one error line before the flow run starts, not a
failed restore task with a traceback. A mesh axis that splits nothing (`idle_axes`) is only
warned of, as the loop starts (`warn_of_idle_axes`); so are the devices that one process of a
program declaring no sharding leaves idle (`warn_of_idle_devices`). And what a trainer says it
trains on (`describe_devices`): its devices, and its mesh.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from prefect_jax.training.sharding import (
    ShardingError,
    check_first_batch,
    declares_sharding,
    init_with_mesh,
    placement,
    spec_axes,
    state_shardings,
    under_mesh,
)

logger = logging.getLogger("prefect_jax.trainer")


def traced_init(program: Any, mesh: Mesh) -> Callable:
    """``init`` of a seed, the key made inside the trace (a traced ``jax.random.key(seed)`` is
    the eager key, for every seed), given the mesh (`init_with_mesh`) and traced under it, so
    that Flax NNX variables with sharding annotations are built as they are."""
    init = under_mesh(init_with_mesh(program.init, mesh), mesh)
    return lambda seed: init(jax.random.key(seed))


def sharded_abstract_state(program: Any, mesh: Mesh, seed: int):
    """``(abstract_state, state_sharding)``: ``jax.eval_shape`` of init under `mesh`, each leaf a
    ShapeDtypeStruct with its NamedSharding, and those shardings (the program's ``shardings``;
    none: replicated). No computation runs.

    Raises:
        ShardingError: init does not trace under the mesh for a reason of its mesh (a sharding
            annotation naming an axis the mesh lacks, say; another error of init's is raised as
            it is), or a declared sharding is refused (`state_shardings`: the message names the
            leaf).
    """
    try:
        shapes = jax.eval_shape(traced_init(program, mesh), np.int64(seed))
    except ShardingError:
        raise
    except Exception as exc:
        said = " ".join(str(exc).split())[:400]
        if not any(word in said.lower() for word in ("mesh", "axis", "axes", "sharding")):
            raise  # the program's own error, with its traceback
        raise ShardingError(
            f"the program's init fails traced under its mesh {dict(mesh.shape)} "
            f"({type(exc).__name__}: {said}): each sharding annotation in it "
            f"(nnx.with_partitioning, a PartitionSpec) must name axes of {list(mesh.axis_names)} "
            "(mesh_axes) and split only dimensions their sizes divide"
        ) from exc
    shardings = getattr(program, "shardings", None)
    specs = shardings(shapes, mesh) if callable(shardings) else None
    state_sharding = state_shardings(specs, shapes, mesh)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, state_sharding
    )
    return abstract, state_sharding


def abstract_state_of(program: Any, seed: int):
    """``jax.eval_shape`` of the program's init as the loop traces it (one process's devices):
    given the mesh and traced under it where the program declares sharding."""
    if declares_sharding(program):
        mesh = placement(program, jax.devices(), 1)[0]
        return sharded_abstract_state(program, mesh, seed)[0]
    return jax.eval_shape(lambda: program.init(jax.random.key(seed)))


def check_train_batch(loop: Any) -> None:
    """A sharded program's first train batch splits over the loop's mesh: checked where a role
    trains, before its restore or init (an evaluator or exporter never takes a train batch, so
    a device count that does not divide it is no reason to refuse one)."""
    if loop.sharded:
        check_first_batch(loop.program.train_data(loop.spec.seed), loop.batch_sharding)


def check_sharding(
    program: Any,
    seed: int = 0,
    resumed: dict | None = None,
    trains: bool = True,
    params: dict | None = None,
):
    """What the loop refuses of a sharded program's mesh, state and first batch, refused before
    anything starts (one process: several see their devices only once JAX's distributed
    runtime is up, which the flow run starts; the loop checks there).

    Args:
        program: the loaded program.
        seed: the job's seed (its first batch).
        resumed: the metadata of the step a rerun resumes from. Its state's shardings were
            checked when that step's attempt began: traced again only where the mesh is not the
            one it recorded (the devices or the ``mesh`` changed), so a rerun on the same mesh
            does not pay the trace twice (its trainer checks as it starts). The mesh and the
            first batch are checked either way; a batch that a mesh other than the recorded one
            cannot split names the mesh the job trained on.
        trains: whether this process trains (its first batch checked); an evaluator never takes
            a train batch.
        params: the program params it was built with: one that set its mesh is named in the
            refusal of that mesh (`mesh_param_named`).

    Returns:
        The abstract state it traced (``jax.eval_shape`` of init), or None where it traced none
        (a program without shardings, a rerun on its mesh).

    Raises:
        ShardingError: see `placement`, `sharded_abstract_state` and `check_first_batch`.
    """
    if not declares_sharding(program):
        return None
    mesh, _, batch, _ = placement_naming_params(program, jax.devices(), 1, params)
    trained_on = (resumed or {}).get("mesh")
    fix = ""
    if trained_on and trained_on != dict(mesh.shape):  # the mesh changed, not the batch
        fix = (
            f"the job trained on the mesh {trained_on}: give it a mesh whose axes divide its "
            "batch (the program's mesh, the number of devices), or start a new job"
        )
    if trains:
        check_first_batch(program.train_data(seed), batch, fix)
    if resumed is None or trained_on != dict(mesh.shape):
        return sharded_abstract_state(program, mesh, seed)[0]
    return None


def placement_naming_params(program: Any, devices, processes: int, params: dict | None):
    """`sharding.placement`, whose refusal of the program's mesh names the program param that
    set it (`mesh_param_named`): the command's preflight and the loop of a flow run alike."""
    try:
        return placement(program, devices, processes)
    except ShardingError as exc:
        named = mesh_param_named(exc, program, params)
        if named is exc:
            raise
        raise named from exc


def mesh_param_named(exc: ShardingError, program: Any, params: dict | None) -> ShardingError:
    """`exc` (a refusal of the program's ``mesh_axes``) naming the program param whose value is
    that mesh: the user typed ``--program-param mesh=...`` (or a flow's ``program_params``),
    not ``mesh_axes``; `exc` itself where no param set it."""
    import json

    axes = getattr(program, "mesh_axes", None)
    given = [k for k, v in (params or {}).items() if isinstance(v, dict) and v == axes]
    if not given or "mesh_axes=" not in str(exc):
        return exc
    return ShardingError(
        f"{exc}. The program param {given[0]}={json.dumps(axes)} set it: --program-param "
        f"{given[0]}=... in a command, program_params[{given[0]!r}] in a flow; left out, the "
        "program's default"
    )


def idle_axes(mesh: Mesh, state_sharding, batch: NamedSharding) -> list[str]:
    """The mesh's axes of more than one device that split neither the batches nor any leaf of
    the state: the devices along such an axis hold the same state and the same batch, and
    repeat the same work (a mesh axis the program's ``shardings`` and ``batch_spec`` never
    name, such as a misspelt one). Leaves of `state_sharding` are NamedShardings or
    PartitionSpecs."""
    used = set(spec_axes(batch.spec))
    for leaf in jax.tree.leaves(state_sharding):
        used.update(spec_axes(getattr(leaf, "spec", leaf)))
    return [axis for axis, size in mesh.shape.items() if size > 1 and axis not in used]


def warn_of_idle_axes(mesh: Mesh, state_sharding, batch: NamedSharding) -> list[str]:
    """Log a warning naming the mesh's `idle_axes`, from the first JAX process (the job still
    runs: a model may use an axis the engine cannot see, in its own sharding constraints);
    returns them."""
    idle = idle_axes(mesh, state_sharding, batch)
    if idle and jax.process_index() == 0:  # (each process builds the same mesh: one line)
        devices = math.prod(mesh.shape[a] for a in idle)
        logger.warning(
            "mesh axis %s of %s splits neither the state nor the batches: its %d devices each "
            "repeat the same work. Name it in the program's shardings (or batch_spec), or leave "
            "it out of mesh_axes",
            ", ".join(map(repr, idle)),
            dict(mesh.shape),
            devices,
        )
    return idle


def warn_of_idle_devices(program: Any) -> int:
    """One process of a program that declares no sharding trains on its first device (as a bare
    `jax.jit` does): where it has more, log a warning naming them and the fix (a probe's user saw
    "training on 8 x cpu" and trained on one). Returns how many are idle."""
    idle = len(jax.devices()) - 1
    if declares_sharding(program) or jax.process_count() > 1 or idle < 1:
        return 0
    logger.warning(
        "the program declares no mesh_axes or shardings: it trains on 1 of this process's %d "
        "devices, %d idle. Declare mesh_axes = {'data': -1} for data parallel over "
        "all of them (a batch size that %d divides), see docs/program.md's Sharding",
        idle + 1,
        idle,
        idle + 1,
    )
    return idle


def describe_devices(mesh=None) -> str:
    """``"1 x NVIDIA H100 80GB HBM3 (gpu)"``, ``"16 x TPU v5 lite (tpu), 4 processes"``,
    ``"1 of 8 x cpu (cpu)"`` (a program declaring no sharding, in one process); with
    the program's `mesh` (a sharded program), its axes: ``"8 x cpu (cpu), mesh fsdp=4 model=2"``
    (a job resumed on another device count gets another mesh: this says which it trains on)."""
    devices = jax.devices()
    kinds = ", ".join(sorted({d.device_kind for d in devices}))
    # (one process of a program declaring no sharding trains on its first: `warn_of_idle_devices`)
    used = "1 of " if mesh is None and jax.process_count() == 1 and len(devices) > 1 else ""
    text = f"{used}{len(devices)} x {kinds} ({jax.default_backend()})"
    text += f", {jax.process_count()} processes" if jax.process_count() > 1 else ""
    if mesh is not None:
        text += ", mesh " + " ".join(f"{axis}={size}" for axis, size in mesh.shape.items())
    return text


def whole_where_indivisible(place: Callable) -> Callable:
    """`place` (a loop's batch placement) for eval batches: split over the data axes as a train
    batch is, where they divide it, so that each device evaluates its part (left whole, a
    data-parallel state's replicas each evaluated the whole batch); one they do not divide (a
    short last batch) stays whole, as before."""

    def placed(batch):
        try:
            return place(batch)
        except ShardingError:
            return batch

    return placed
