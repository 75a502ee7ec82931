"""The user's program: what the engine trains.

A program is any object that provides:

- ``init(rng) -> state``: the train state, a pytree of arrays (Flax NNX state + optax
  state, or any pytree). ``rng`` is a ``jax.random.key``.
- ``train_step(state, batch) -> (state, metrics)``: pure and jit-able; ``metrics`` is a
  dict of scalars, each logged as the mean over the steps since the previous log point (summed
  on the device). Any randomness comes from keys kept inside ``state``.
- ``eval_step(state, batch) -> metrics``: pure and jit-able; a dict mapping each metric
  name to a ``(sum, count)`` pair, so the engine aggregates exactly over batches of any size.
- ``train_data(seed) -> grain dataset``: an endless Grain ``MapDataset`` or ``IterDataset``
  of batches (its iterator state is checkpointed with the model).
- ``eval_data() -> grain dataset``: a finite Grain dataset of eval batches.

Optionally:

- ``serve(state, inputs) -> outputs`` and ``serving_input() -> jax.ShapeDtypeStruct``: what
  exporters write (a serialized ``jax.export`` artifact that runs without the program's code);
  ``serving_example()``: the MLflow input example (an array, or a dict of them).
- ``eval_metric_names``: the names ``eval_step`` returns (a sequence, or a function returning
  one), so that ``--best-metric`` is checked before any work without reading an eval batch.
- ``derive_metrics(means) -> dict[str, float]``: eval metrics computed from the aggregated
  means (``{name: sum / count}`` over the whole eval set), e.g. perplexity ``exp(means["loss"])``;
  new names only. They join the evaluation's metrics (MLflow, records, ``BestExporter``).
- ``tokens_per_step``: tokens one train step consumes: the engine logs ``tokens_per_sec``.
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
can carry the name as a JSON parameter. The attribute may be a factory whose one parameter is
typed (a pydantic model or a dataclass): the job's ``program_params`` (a JSON-able dict) are
validated into that type and the factory is called with it; a ``max_steps`` field left None is
filled with the job's ``max_steps`` (see `prefect_jax.training.program_params`, and
docs/program.md).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from typing import Any

from prefect_jax.training.program_params import ProgramParams, validate_params
from prefect_jax.training.program_params_types import params_type

REQUIRED = ("init", "train_step", "eval_step", "train_data", "eval_data")
SERVING = ("serve", "serving_input")


class ProgramError(ValueError):
    """The program path cannot be loaded, or the object lacks part of the contract."""


def import_path(
    path: str,
    what: str,
    form: str = "'package.module:attribute'",
    example: str | None = None,
) -> Any:
    """The object that `path` names, ``"package.module:attribute"`` (dotted attributes too): the
    one way a program, a hook or a compare function named in a spec is found.

    Raises:
        ProgramError: `path` is not of `form`, its module does not import, or the module lacks
            the attribute (the message lists its names, the closest first); each names `what`.
    """
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        shown = f" (for example {example!r})" if example else ""
        raise ProgramError(f"{what} path {path!r} is not of the form {form}{shown}")
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ProgramError(
            f"{what} path {path!r}: cannot import module {module_name!r} ({exc}); check the "
            "spelling, and that the module is installed in this environment or on PYTHONPATH "
            "(the command also imports from its working directory)"
            + _dotted_hint(module_name, attr)
        ) from exc
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        import difflib

        names = sorted(
            n for n, v in vars(module).items() if not n.startswith("_") and _defined_in(v, module)
        )
        close = difflib.get_close_matches(attr, names, n=3)
        shown = ", ".join(repr(n) for n in names[:20]) + (
            f", ... ({len(names) - 20} more)" if len(names) > 20 else ""
        )
        raise ProgramError(
            f"{what} path {path!r}: module {module_name!r} has no attribute {attr!r}"
            + (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "")
            + f" (names it defines: {shown})"
        ) from exc
    return obj


def _defined_in(value: Any, module) -> bool:
    """Whether `value` is the module's own: not a module it imports (``np``) nor a function or
    class it imports from another (a package's from its own modules are its own, and so is an
    object it makes of an imported class)."""
    if inspect.ismodule(value) or type(value).__module__ == "__future__":  # (`annotations`)
        return False
    if inspect.isclass(value) or inspect.isroutine(value):
        home = getattr(value, "__module__", None) or module.__name__
        return home == module.__name__ or home.startswith(module.__name__ + ".")
    return True


def _dotted_hint(module: str, attr: str) -> str:
    """For a module named as a file (``mypkg/model.py``): the dotted name it means."""
    dotted = module.removesuffix(".py").replace("/", ".").replace("\\", ".").strip(".")
    return f" (a module by its dotted name: {dotted}:{attr}?)" if dotted != module else ""


def made_if_class(obj: Any, path: str, what: str, otherwise: str) -> Any:
    """`obj`, or an instance of it if it is a class (made with no arguments)."""
    if not isinstance(obj, type):
        return obj
    try:
        return obj()
    except TypeError as exc:
        raise ProgramError(
            f"{what} class {path!r} cannot be made with no arguments ({exc}); give its arguments "
            f"defaults, or {otherwise}"
        ) from exc


def positional_counts(fn: Any, follow_wrapped: bool = True) -> tuple[int, int]:
    """How many positional arguments `fn` requires, and how many it accepts at most (of the
    function a `functools.wraps` decorator wrapped, unless not `follow_wrapped`).

    Raises:
        TypeError, ValueError: `fn` has no signature to read (some builtins).
    """
    import inspect

    required = accepted = 0
    for param in inspect.signature(fn, follow_wrapped=follow_wrapped).parameters.values():
        if param.kind is param.VAR_POSITIONAL:
            accepted = 1_000
        elif param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            accepted += 1
            required += param.default is param.empty
    return required, accepted


def check_called_with(fn: Any, count: int, what: str, shape: str) -> None:
    """Refuse `fn` (`what`: its kind and path, for the message) unless it can be called with
    `count` positional arguments, as `shape` is: where it is loaded, not at its first call, maybe
    an interval's training later. One without a signature to read is called as documented.

    Raises:
        ProgramError: It cannot; the message names it and `shape`.
    """
    try:
        required, accepted = positional_counts(fn)
        if (required > count or accepted < count) and hasattr(fn, "__wrapped__"):
            # a decorator's own signature: it may supply the wrapped function's other arguments
            required, accepted = positional_counts(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return
    if required > count or accepted < count:
        at_most = "any number" if accepted >= 1_000 else accepted
        raise ProgramError(
            f"{what} takes {required} required positional arguments (at most {at_most}), and is "
            f"called with {count}: define it as {shape}"
        )


def load_program(
    path: str, params: dict[str, Any] | None = None, max_steps: int | None = None
) -> Any:
    """Import ``"package.module:attribute"`` and check it provides the program contract.

    Args:
        path: import path of the program object, e.g. ``"prefect_jax.examples.digits:program"``.
        params: the program's parameters, for a factory with a typed parameter (see
            `load_program_with_params`); None or ``{}`` for none.
        max_steps: the job's ``max_steps``, filled into a ``max_steps`` field left None.

    Returns:
        The program object. If the attribute is a class or a factory function taking no
        arguments, it is called once to build the program; if its one parameter is typed (a
        pydantic model or a dataclass), it is called with `params` validated into that type.

    Raises:
        ProgramError: the path is malformed, the module or attribute does not exist, the
            object misses a required method (the message lists them), or `params` were given
            to a program that takes none.
        ProgramParamsError: `params` do not fit the program's parameter type (the message names
            the key and value and lists the fields with their types).
    """
    return load_program_with_params(path, params, max_steps)[0]


def load_program_with_params(
    path: str, params: dict[str, Any] | None = None, max_steps: int | None = None
) -> tuple[Any, ProgramParams]:
    """`load_program`, and the parameters it was built with, as they are recorded (in
    checkpoints, MLflow params, ``status``) and checked when the job restores a step."""
    obj = import_path(path, "program", example="prefect_jax.examples.digits:program")
    recorded = ProgramParams()
    if isinstance(obj, type) or (callable(obj) and not all(hasattr(obj, m) for m in REQUIRED)):
        typed = params_type(obj)
        if typed is not None:
            instance, recorded = validate_params(typed, params, path, max_steps)
            obj = obj(instance)
        else:
            _refuse_params(path, params, "a factory without a typed parameter")
            try:
                obj = obj()
            except TypeError as exc:
                raise ProgramError(
                    f"program path {path!r} names a callable that could not be called without "
                    f"arguments ({exc}); point it at a program object, a zero-argument factory "
                    "or a factory whose one parameter is a pydantic model or a dataclass"
                ) from exc
    else:
        _refuse_params(path, params, "a program object")
    check_program(obj, path)
    return obj, recorded


def _refuse_params(path: str, params: dict[str, Any] | None, what: str) -> None:
    if params:
        raise ProgramError(
            f"program params {params!r} were given, but {path!r} names {what}, which takes "
            "none: drop the params, or point the path at a factory whose one parameter is a "
            "pydantic model or a dataclass (see docs/program.md)"
        )


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
