"""The user's program: what the engine trains.

A program is any object that provides:

- ``init(rng) -> state``: the train state, a pytree of arrays (Flax NNX state + optax
  state, or any pytree). ``rng`` is a ``jax.random.key``.
- ``train_step(state, batch) -> (state, metrics)``: pure and jit-able; ``metrics`` is a
  dict of scalars. Any randomness comes from keys kept inside ``state``.
- ``eval_step(state, batch) -> metrics``: pure and jit-able; a dict mapping each metric
  name to a ``(sum, count)`` pair, so the engine aggregates exactly over batches of any size.
- ``train_data(seed) -> grain dataset``: an endless Grain ``MapDataset`` or ``IterDataset``
  of batches (its iterator state is checkpointed with the model).
- ``eval_data() -> grain dataset``: a finite Grain dataset of eval batches.

Optionally:

- ``serve(state, inputs) -> outputs`` and ``serving_input() -> jax.ShapeDtypeStruct``: what
  exporters write (a serialized ``jax.export`` artifact that runs without the program's code).
- ``config``: a JSON-able dict describing the program, part of its fingerprint.
- ``read_options``: the ``grain.ReadOptions`` the trainer iterates a ``MapDataset`` from
  ``train_data`` with (default Grain's: prefetch threads, right for heavy per-record work;
  a pipeline that only slices arrays is faster with ``grain.ReadOptions(num_threads=0)``).

Sharding (optional; see `prefect_jax.training.sharding` and docs/program.md, "Sharding"). A
program that declares neither keeps the engine's default placement: one device, or data parallel
with a replicated state over several processes.

- ``mesh_axes``: ``{axis: size}``, the device mesh over every device of every process, in order;
  one size may be ``-1``, the devices the others leave (``{"data": -1}``, ``{"data": 4,
  "model": 2}``). Default, when only ``shardings`` is given: ``{"data": -1}``.
- ``shardings(abstract_state, mesh)``: a pytree matching the state (``jax.eval_shape`` of init) of
  ``PartitionSpec``, ``NamedSharding`` on `mesh`, or None (replicated); None for the whole
  tree replicates everything. `prefect_jax.training.sharding.fsdp` is the ready FSDP rule; for
  an ``nnx.State`` built with ``nnx.with_partitioning``, ``nnx.get_partition_spec(state)``.
- ``batch_spec``: the ``PartitionSpec`` of each batch leaf (default: the leading axis split over
  the mesh's ``data`` and ``fsdp`` axes).
- ``init(rng, mesh)``: with a mesh, init is traced with it in context (Flax NNX's sharding
  annotations apply as they are), and given it as ``mesh=`` when its signature takes ``mesh``.
  The train and eval steps are traced under the mesh too and jitted with the state's shardings
  in and out; checkpoints restore into them (Orbax reshards, so a job resumes on another mesh or
  device count).

Programs are named by import path, ``"package.module:attribute"``, so a Prefect deployment
can carry the name as a JSON parameter.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from typing import Any

REQUIRED = ("init", "train_step", "eval_step", "train_data", "eval_data")
SERVING = ("serve", "serving_input")


class ProgramError(ValueError):
    """The program path cannot be loaded, or the object lacks part of the contract."""


def load_program(path: str) -> Any:
    """Import ``"package.module:attribute"`` and check it provides the program contract.

    Args:
        path: import path of the program object, e.g. ``"prefect_jax.examples.digits:program"``.

    Returns:
        The program object. If the attribute is a class or a factory function taking no
        arguments, it is called once to build the program.

    Raises:
        ProgramError: the path is malformed, the module or attribute does not exist, or the
            object misses a required method (the message lists them).
    """
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ProgramError(
            f"program path {path!r} is not of the form 'package.module:attribute' "
            "(for example 'prefect_jax.examples.digits:program')"
        )
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ProgramError(
            f"program path {path!r}: cannot import module {module_name!r} ({exc}); "
            "check the spelling and that the module is installed in this environment"
        ) from exc
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise ProgramError(
            f"program path {path!r}: module {module_name!r} has no attribute {attr!r}; "
            f"names it defines: {sorted(n for n in vars(module) if not n.startswith('_'))[:20]}"
        ) from exc
    if isinstance(obj, type) or (callable(obj) and not all(hasattr(obj, m) for m in REQUIRED)):
        try:
            obj = obj()
        except TypeError as exc:
            raise ProgramError(
                f"program path {path!r} names a callable that could not be called without "
                f"arguments ({exc}); point it at a program object or a zero-argument factory"
            ) from exc
    check_program(obj, path)
    return obj


def check_program(program: Any, name: str = "program") -> None:
    """Raise ProgramError naming every required method the program lacks."""
    missing = [m for m in REQUIRED if not callable(getattr(program, m, None))]
    if missing:
        raise ProgramError(
            f"{name} ({type(program).__name__}) is missing {', '.join(missing)}: a program must "
            "provide init(rng), train_step(state, batch), eval_step(state, batch), "
            "train_data(seed) and eval_data() (see prefect_jax.training.program)"
        )


def has_serving(program: Any) -> bool:
    return all(callable(getattr(program, m, None)) for m in SERVING)


def program_fingerprint(path: str, program: Any) -> str:
    """A short hash of the program's path and its ``config`` (if it has one)."""
    config = getattr(program, "config", None)
    blob = json.dumps({"path": path, "config": config}, sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
