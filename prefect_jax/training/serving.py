"""A program's serving inputs: their structure, their signature, an example, and the check of
``serve`` made before training.

``serving_input()`` returns one ``jax.ShapeDtypeStruct`` (``serve(state, inputs)`` gets one
array) or a dict ``{name: jax.ShapeDtypeStruct}`` (``serve`` gets a dict of arrays). A dimension
may be symbolic (``jax.export.symbolic_shape("b, s", constraints=("s <= 512",))``): the export
takes any size there (within the constraints), and the MLflow signature says -1. Several inputs
share one symbolic scope: make their dims with one ``symbolic_shape`` call.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from prefect_jax.training.eval_specs import ALL_PLATFORMS, EXPORT_PLATFORMS

logger = logging.getLogger("prefect_jax.trainer")

# The size an example takes on a symbolic dimension other than the batch when no eval batch fits.
_EXAMPLE_DIM = 8

_FIX = (
    "return one jax.ShapeDtypeStruct or a dict {name: jax.ShapeDtypeStruct}; a variable "
    'dimension is jax.export.symbolic_shape("b, s") (one call for all the inputs\' dims)'
)


def serving_specs(program: Any, name: str | None = None):
    """``program.serving_input()``, checked: one ``ShapeDtypeStruct`` or a dict of them.

    Raises:
        ValueError: anything else (naming the program and the fix).
    """
    import jax

    spec = program.serving_input()
    who = f"program {name!r}" if name else "the program"
    if isinstance(spec, dict):
        bad = {k: v for k, v in spec.items() if not isinstance(v, jax.ShapeDtypeStruct)}
        if not spec or bad or not all(isinstance(k, str) and k for k in spec):
            raise ValueError(f"{who}'s serving_input() returned {spec!r}: {_FIX}, named by strings")
        return spec
    if not isinstance(spec, jax.ShapeDtypeStruct):
        raise ValueError(f"{who}'s serving_input() returned {spec!r}: {_FIX}")
    return spec


def _dim(d) -> int | str:
    return d if isinstance(d, int) else str(d)


def serving_ranges(program: Any, spec, name: str | None = None) -> dict:
    """``program.serving_input_range()``, checked against the serving inputs `spec`:
    ``{input name (None for one array): (low, high)}``, the values an integer input takes,
    ``low <= x < high`` (token ids: ``(0, vocab)``); {} where the program has none. The pyfunc
    refuses values outside, which an embedding's lookup would turn into NaN or another row.

    Raises:
        ValueError: not a ``(low, high)`` pair of ints (a dict of them by input name for named
            inputs), an unknown name, ``low >= high``, or an input that is not integer.
    """
    import numpy as np

    given = None
    if callable(getattr(program, "serving_input_range", None)):
        given = program.serving_input_range()
    if given is None:
        return {}
    who = f"program {name!r}" if name else "the program"
    named = isinstance(spec, dict)
    ranges = given if named and isinstance(given, dict) else {None: given}
    specs = spec if named else {None: spec}
    fix = (
        "return (low, high) with ints low < high (values low <= x < high), for an integer "
        "input; a dict {name: (low, high)} of some of serving_input()'s names; or None"
    )
    out = {}
    for key, pair in ranges.items():
        bounds = _int_pair(pair)
        if (
            key not in specs
            or bounds is None
            or bounds[0] >= bounds[1]
            or not np.issubdtype(np.dtype(specs[key].dtype), np.integer)
        ):
            raise ValueError(f"{who}'s serving_input_range() returned {given!r}: {fix}")
        out[key] = bounds
    return out


def _int_pair(pair) -> tuple[int, int] | None:
    """`pair` as two ints (NumPy's too: a vocabulary's size often is one), or None."""
    import operator

    if (
        not isinstance(pair, (tuple, list))
        or len(pair) != 2
        or any(isinstance(v, bool) for v in pair)
    ):
        return None
    try:
        return operator.index(pair[0]), operator.index(pair[1])
    except TypeError:
        return None


def symbolic_constraints(spec) -> list[str]:
    """The constraints given to ``jax.export.symbolic_shape`` that name a dimension of `spec` (one
    ShapeDtypeStruct): ``["seq <= 512"]``. A serialized export loses them (its refusal of a
    sequence too long says only "Error refining shapes"), so the export's record keeps them for
    the pyfunc to name. JAX has no public accessor: they are read from the symbolic scope's
    description, which lists them after "with constraints:" ([] if it changes)."""
    symbolic = [d for d in spec.shape if hasattr(d, "scope")]
    names = {n for d in symbolic for n in re.findall(r"[A-Za-z_]\w*", str(d))}
    found: list[str] = []
    for scope in {id(d.scope): d.scope for d in symbolic}.values():
        _, said, listed = str(scope).partition("with constraints:")
        if said:  # (the scope's, for all the inputs that share it: this input's alone)
            lines = [line.strip() for line in listed.splitlines() if line.strip()]
            found += [c for c in lines if names & set(re.findall(r"[A-Za-z_]\w*", c))]
    return list(dict.fromkeys(found))


def input_signature(spec, ranges: dict | None = None) -> list[dict]:
    """The serving inputs as JSON (``export.json``, one of the MLflow model's files, where the
    pyfunc reads them): ``[{"name", "shape", "dtype"}]``, a symbolic dimension by its expression
    (``"b"``), the name None for a single array input; ``"constraints"`` where its dims have some
    (`symbolic_constraints`), ``"values": [low, high]`` where `ranges` (`serving_ranges`) has it."""
    import numpy as np

    items = spec.items() if isinstance(spec, dict) else [(None, spec)]
    out = []
    for k, s in items:
        one = {"name": k, "shape": [_dim(d) for d in s.shape], "dtype": np.dtype(s.dtype).name}
        if constraints := symbolic_constraints(s):
            one["constraints"] = constraints
        if ranges and k in ranges:
            one["values"] = list(ranges[k])
        out.append(one)
    return out


def serving_record(program: Any) -> list[dict]:
    """What an export records of its program's serving inputs (`input_signature`, their value
    ranges in)."""
    spec = serving_specs(program)
    return input_signature(spec, serving_ranges(program, spec))


def _fitting(leaves, spec, rows: int, bounds: tuple[int, int] | None = None):
    """The first of `leaves` (NumPy) whose rank, fixed dims and dtype fit `spec`, cut to `rows`;
    with its values within `bounds` (``low <= x < high``) where given."""
    import numpy as np

    for leaf in leaves:
        leaf = np.asarray(leaf)
        if (
            leaf.ndim == len(spec.shape)
            and all(
                not isinstance(d, int) or d == n
                for d, n in zip(spec.shape[1:], leaf.shape[1:], strict=True)
            )
            and np.can_cast(leaf.dtype, spec.dtype, "same_kind")
        ):
            cut = leaf[:rows]
            if bounds is None or not cut.size or bounds[0] <= cut.min() <= cut.max() < bounds[1]:
                return cut.astype(spec.dtype)
    return None


def _zeros(spec, rows: int, bounds: tuple[int, int] | None = None):
    """An array of `spec`'s shape (`rows` on a symbolic batch), of zeros, or of `bounds`' low."""
    import numpy as np

    first = spec.shape[0] if spec.shape and isinstance(spec.shape[0], int) else rows
    tail = [d if isinstance(d, int) else _EXAMPLE_DIM for d in spec.shape[1:]]
    fill = bounds[0] if bounds is not None else 0
    return np.full((first, *tail)[: len(spec.shape)], fill, dtype=spec.dtype)


def serving_example(program: Any, rows: int = 5):
    """A few real serving inputs (NumPy; a dict of arrays for named inputs):
    ``program.serving_example()`` if the program has one; else for each input the first rows of
    the first eval batch's array that fits it (a dict batch's array of the same name first),
    within its `serving_ranges`; zeros (the range's low) of its shape where nothing fits (a
    symbolic dimension other than the batch takes a small size)."""
    import jax
    import numpy as np

    if callable(getattr(program, "serving_example", None)):
        example = program.serving_example()
        if isinstance(example, dict):
            return {k: np.asarray(v) for k, v in example.items()}
        return np.asarray(example)
    spec = serving_specs(program)
    specs = spec if isinstance(spec, dict) else {None: spec}
    ranges = serving_ranges(program, spec)  # (an example the model refuses is no example)
    found: dict = {}
    try:
        data = program.eval_data()
        batch = data[0] if hasattr(data, "__getitem__") else next(iter(data))
        leaves = jax.tree.leaves(batch)
        for name, s in specs.items():
            named = [batch[name]] if isinstance(batch, dict) and name in batch else []
            found[name] = _fitting([*named, *leaves], s, rows, ranges.get(name))
    except Exception:  # noqa: BLE001 - an example is a nicety; the zeros below still fit the signature
        pass
    out = {
        k: found[k] if found.get(k) is not None else _zeros(s, rows, ranges.get(k))
        for k, s in specs.items()
    }
    return out if isinstance(spec, dict) else out[None]


def check_serving(
    program: Any, name: str, abstract_state, platforms: list[str] | None = None
) -> None:
    """Before training: trace ``serve`` on the abstract state and the serving input
    (``jax.eval_shape``), then lower it with ``jax.export`` for the named `platforms`
    (``EvalSpec.export_platforms``; else for this machine's: those the export may leave out
    are found there), so that a broken ``serve`` fails in seconds, not at the job's first export
    an interval in.

    Raises:
        ValueError: ``serving_input()`` is not a ShapeDtypeStruct (or dict of them); ``serve``
            does not trace on it (an ``int()`` on a symbolic dimension...); or it does not lower
            for named `platforms` (each named, with its error); ``serving_input_range()`` is
            not what `serving_ranges` takes.
    """
    import jax

    spec = serving_specs(program, name)
    serving_ranges(program, spec, name)
    # one device, as an export's constants
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract_state)
    try:
        jax.eval_shape(program.serve, state, spec)
    except Exception as exc:
        said = " ".join(str(exc).split())
        if "mesh" in said.lower():  # Flax building an annotated model (nnx.with_partitioning)
            fix = (
                "serve is traced and exported for one device, with no mesh: build the model it "
                "merges outside any mesh with Flax's eager sharding off (docs/program.md, "
                "Sharding)"
            )
        else:
            fix = (
                "a symbolic dimension has no int() value: use x.shape[i] in jnp operations, or "
                "bound it with symbolic_shape(..., constraints=...)"
            )
        raise ValueError(
            f"program {name!r}: serve(state, inputs) does not trace on serving_input() "
            f"{input_signature(spec)} ({type(exc).__name__}: {said[:400]}). Fix serve ({fix}) or "
            "serving_input before training; the exports would fail after each interval"
        ) from exc
    wanted, named = resolve_platforms(platforms)
    fn = jax.jit(lambda state, inputs: program.serve(state, inputs))
    failed = failing_platforms(
        fn, wanted if named else (jax.export.default_export_platform(),), state, spec
    )
    if failed:
        raise named_platforms_error(failed, wanted, name)


def check_serving_early(
    program: Any, name: str, platforms: list[str] | None, seed: int, abstract_state=None
) -> tuple[str, ...]:
    """`check_serving` before the job's trainer exists (a command's preflight, before the
    compile begins): on `abstract_state` where the sharding check traced one, else on
    ``jax.eval_shape`` of the program's init (`sharded_state.abstract_state_of`). The platforms
    it was checked for, which the trainer need not check again (`head_start`)."""
    if abstract_state is None:
        from prefect_jax.training.sharded_state import abstract_state_of

        abstract_state = abstract_state_of(program, seed)
    check_serving(program, name, abstract_state, platforms)
    return tuple(platforms or ())


def resolve_platforms(
    platforms: list[str] | tuple[str, ...] | None,
) -> tuple[tuple[str, ...], bool]:
    """The platforms an export lowers for (``EvalSpec.export_platforms``), and whether the user
    named them (then each must lower). None: this machine's platform (where the job trains) and
    ``cpu`` (a laptop loads it); ``["all"]``: every one of `EXPORT_PLATFORMS`; for those two, a
    platform ``serve`` does not lower for is left out with a warning."""
    import jax

    here = jax.export.default_export_platform()
    if not platforms:
        return tuple(dict.fromkeys((here, "cpu"))), False
    if ALL_PLATFORMS in platforms:
        return tuple(dict.fromkeys((*EXPORT_PLATFORMS, here))), False
    return tuple(platforms), True


def failing_platforms(fn, platforms, *args) -> dict[str, Exception]:
    """The platforms `fn` does not lower for, each tried alone, with its error."""
    import jax

    failed = {}
    for platform in platforms:
        try:
            jax.export.export(fn, platforms=(platform,))(*args)
        except Exception as exc:  # noqa: BLE001 - named by the caller, or raised as it is
            failed[platform] = exc
    return failed


def why_platforms_fail(failed: dict[str, Exception]) -> str:
    return "; ".join(
        f"{p}: {type(e).__name__}: {' '.join(str(e).split())[:300]}" for p, e in failed.items()
    )


def named_platforms_error(
    failed: dict[str, Exception], platforms, program: str | None = None
) -> ValueError:
    """The refusal of named `platforms` that ``serve`` does not lower for."""
    who = f"program {program!r}: " if program else ""
    return ValueError(
        f"{who}the program's serve() does not lower for {list(failed)} of "
        f"export_platforms={list(platforms)} ({why_platforms_fail(failed)}); leave them out of "
        "EvalSpec.export_platforms (--export-platforms)"
    )
