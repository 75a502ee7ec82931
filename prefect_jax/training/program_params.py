"""A program's typed parameters: validated from a dict, recorded, checked on restore.

A program path may name a factory whose one parameter is annotated with a pydantic ``BaseModel``
or a dataclass (``def program(params: ByteLMParams) -> ByteLMProgram``). The engine validates
the job's ``program_params`` (a dict: from ``--program-param``, a flow parameter or a deployment)
into that type and calls the factory with it. Two declarations on the type matter to the engine:

- a field named ``max_steps`` (an ``int | None``) left None is filled with the job's
  ``TrainSpec.max_steps``, so a program can tie its learning-rate schedule's horizon to the job;
  a value filled so is recorded but not compared on restore (a job resumed with a larger
  ``max_steps`` stretches its schedule from there on, as the user asked);
- ``restore_exempt``, a class attribute naming fields that do not change what is computed
  (reading threads, prefetch depth): recorded, never compared on restore.

Every other field's value is recorded in each checkpoint's metadata (``program_params``), logged
as MLflow params ``program.<field>``, and compared when a job restores one of its own steps: a
difference refuses the restore (`ProgramParamsMismatchError`) before any training. A field added
to the type since the step was saved counts as the same where it has its default (the program
ran as the default says before the field existed), as does one removed since, saved at its
default.

This module imports neither jax nor prefect.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from prefect_jax.training.program_params_types import (
    describe_fields,
    field_annotations,
    field_defaults,
    field_types,
    takes_a_boolean,
)

ENGINE_FILLED = ("max_steps",)
EXEMPT_ATTR = "restore_exempt"
META_KEY = "program_params"
# A field one side of a restore lacks (added to the type since, or removed), as diffs show it.
UNSET = "<unset>"


class ProgramParamsError(ValueError):
    """Program parameters that do not fit the program's parameter type."""


class ProgramParamsMismatchError(ValueError):
    """A job's checkpoint was trained with other program parameters than the ones given."""


@dataclasses.dataclass(frozen=True)
class ProgramParams:
    """The parameters a program was built with, as recorded.

    Args:
        type_name: the parameter type's name (None: the program takes no parameters).
        values: every field's value, JSON-able (what the program was built with).
        filled: fields the engine filled from the job (``max_steps``): not compared on restore.
        exempt: fields the type declares do not change the computation: not compared on restore.
        defaults: the default of each field that has one, JSON-able: a field only one side of a
            restore has counts as the same where its value is its default.
        given: the fields the job gave (None: not known, as in steps saved before it was
            recorded; a value the type's validator took from elsewhere, such as the byte LM's
            environment fallback, was not given): a refused restore suggests these where they
            resume the same, not every field they decided.
    """

    type_name: str | None = None
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    filled: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    given: tuple[str, ...] | None = None
    # the type validated into (not recorded): a refusal checks a shorter suggestion with it
    params_type: type | None = dataclasses.field(default=None, compare=False, repr=False)

    def compared(self) -> dict[str, Any]:
        """The values a restore compares: all but the filled and exempt ones."""
        skip = set(self.filled) | set(self.exempt)
        return {k: v for k, v in self.values.items() if k not in skip}

    def as_meta(self) -> dict[str, Any]:
        """What a checkpoint's metadata records (`from_meta` reads it back)."""
        return {
            "type": self.type_name,
            "values": self.values,
            "filled": list(self.filled),
            "exempt": list(self.exempt),
            "defaults": self.defaults,
            "given": None if self.given is None else list(self.given),
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> ProgramParams:
        return cls(
            meta.get("type"),
            dict(meta.get("values") or {}),
            tuple(meta.get("filled") or ()),
            tuple(meta.get("exempt") or ()),
            dict(meta.get("defaults") or {}),
            None if meta.get("given") is None else tuple(meta["given"]),
        )


# Why a value given as true or false is a boolean, wherever the params came from.
_BOOLEANS = "true and false are JSON booleans, in --program-param as in a flow's program_params"


def validate_params(
    tp: type, given: dict[str, Any] | None, where: str, max_steps: int | None = None
) -> tuple[Any, ProgramParams]:
    """`given` validated into `tp`, with ``max_steps`` filled from the job where the type has
    the field and it was not given.

    Args:
        tp: the parameter type (pydantic model or dataclass).
        given: the job's program params (None: none given).
        where: the program's path, for error messages.
        max_steps: the job's ``TrainSpec.max_steps``.

    Returns:
        (the instance the factory is called with, what is recorded of it).

    Raises:
        ProgramParamsError: `given` is not a dict, names a field `tp` lacks, or a value its
            field refuses; the message names the key and value, and lists the fields and types
            (a refused value: its field's type).
    """
    from pydantic import TypeAdapter, ValidationError

    fields = field_types(tp)
    listing = f"fields of {tp.__name__}: {describe_fields(tp)}"
    if given is not None and not isinstance(given, dict):
        raise ProgramParamsError(
            f"program params for {where} must be a dict of {tp.__name__}'s fields, not "
            f"{given!r}; {listing}"
        )
    data = dict(given or {})
    unknown = [k for k in data if k not in fields]
    if unknown:
        import difflib

        bad = ", ".join(f"{k}={data[k]!r}" for k in unknown)
        close = [m for k in unknown for m in difflib.get_close_matches(k, fields, n=1)]
        hint = f" (did you mean {', '.join(repr(m) for m in close)}?)" if close else ""
        raise ProgramParamsError(
            f"program params for {where}: {bad} is not a field of {tp.__name__}{hint}; give "
            f"only its fields ({listing})"
        )
    annotations = field_annotations(tp, metadata=True)
    booleans = [k for k, v in data.items() if isinstance(v, bool)]
    not_booleans = [k for k in booleans if not takes_a_boolean(annotations[k])]
    if not_booleans:
        bad = "; ".join(f"{k}={data[k]!r}: {k} takes {fields[k]}" for k in not_booleans)
        raise ProgramParamsError(
            f"program params for {where} refused: {bad}, not a boolean ({_BOOLEANS}); give a "
            "value of that type"
        )
    filled = []
    if max_steps is not None:
        for name in ENGINE_FILLED:
            if name in fields and data.get(name) is None:
                data[name] = max_steps
                filled.append(name)
    try:
        instance = TypeAdapter(tp).validate_python(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or tp.__name__
            value = err.get("input")
            field = str(err["loc"][0]) if err["loc"] else None
            takes = f" ({field} takes {fields[field]})" if field in fields else ""
            # a validator's own ValueError as it wrote it (pydantic prefixes "Value error, ")
            error = (err.get("ctx") or {}).get("error")
            msg = str(error) if err["type"] == "value_error" and error is not None else err["msg"]
            if not err["loc"]:  # a check of several fields: its message names what it refused
                problems.append(f"{tp.__name__}: {msg}")
                continue
            problems.append(f"{loc}={value!r}: {msg}{takes}")
        # (the refused field is named, with what it takes: the other fields would bury it)
        raise ProgramParamsError(
            f"program params for {where} refused: {'; '.join(problems)}"
        ) from None
    values = json.loads(json.dumps(TypeAdapter(tp).dump_python(instance, mode="json")))
    numbered = [(k, *p) for k in data for p in _booleans_made_numbers(data[k], values.get(k), k)]
    if numbered:
        bad = "; ".join(f"{path}={value!r}: {k} takes {fields[k]}" for k, path, value in numbered)
        raise ProgramParamsError(
            f"program params for {where} refused: {bad}, which made a number of the boolean; "
            f"give a number there ({_BOOLEANS})"
        )
    exempt = tuple(name for name in getattr(tp, EXEMPT_ATTR, ()) if name in fields)
    defaults = field_defaults(tp)
    given_keys = tuple(k for k in (given or {}) if k not in filled)
    return instance, ProgramParams(
        tp.__name__, values, tuple(filled), exempt, defaults, given_keys, params_type=tp
    )


def _booleans_made_numbers(given: Any, validated: Any, path: str) -> list[tuple[str, Any]]:
    """``(path, value)`` of each True or False nested in a given value that validated to a
    number: pydantic's lax mode makes 1 and 0 of them (``hidden=[true, 32]`` for a list of ints).
    A top-level boolean is refused before validation, where its field takes none."""
    if isinstance(given, dict) and isinstance(validated, dict):
        pairs = [(f"{path}.{k}", v, validated.get(str(k))) for k, v in given.items()]
    elif isinstance(given, list | tuple) and isinstance(validated, list):
        if len(given) != len(validated):
            return []
        pairs = [(f"{path}[{i}]", v, validated[i]) for i, v in enumerate(given)]
    else:
        return []
    out = []
    for where, value, became in pairs:
        if not isinstance(value, bool):
            out.extend(_booleans_made_numbers(value, became, where))
        elif isinstance(became, int | float) and not isinstance(became, bool):
            out.append((where, value))
    return out


def differences(saved: ProgramParams, given: ProgramParams) -> list[tuple[str, Any, Any]]:
    """``(field, saved value, given value)`` for each compared field that differs. A field only
    one side has (added to the type, or removed from it, since the step was saved) is the same
    where its value is its default there, else differs, with ``<unset>`` on the other side."""
    a, b = saved.compared(), given.compared()
    skip = set(saved.filled) | set(saved.exempt) | set(given.filled) | set(given.exempt)
    out = []
    for key in sorted((set(a) | set(b)) - skip):
        if key not in a and key in given.defaults and b[key] == given.defaults[key]:
            continue  # added since, at its default: what the step's program did without it
        if key not in b and key in saved.defaults and a[key] == saved.defaults[key]:
            continue  # removed since, saved at its default
        if a.get(key, UNSET) != b.get(key, UNSET):
            out.append((key, a.get(key, UNSET), b.get(key, UNSET)))
    return out


def _params_to_give(
    saved: ProgramParams, given: ProgramParams, diffs: list[tuple[str, Any, Any]]
) -> dict[str, Any]:
    """The program params that resume `saved`'s step, for a refusal to suggest: every compared
    field that differs, at its saved value; or, shorter where it resumes the same (validated
    into the params type, nothing differs then), the fields its run was given and those given
    now that differ (a preset, not each field it decided). Exempt fields are never suggested."""
    every = {k: s for k, s, g in diffs if UNSET not in (s, g)}
    tp = given.params_type
    if saved.given is None or given.given is None or tp is None:
        return every
    skip = set(saved.exempt) | set(given.exempt) | set(saved.filled)
    fewer = {
        k: saved.values[k]
        for k in saved.given
        if k in saved.values and k in given.values and k not in skip
    }
    fewer.update({k: every[k] for k in given.given if k in every})
    if len(fewer) >= len(every):
        return every
    try:
        resumed = validate_params(tp, fewer, tp.__name__)[1]
    except Exception:  # noqa: BLE001 - (a preset that no longer exists): every field then
        return every
    return every if differences(saved, resumed) else fewer


def _as_flags(params: dict[str, Any]) -> str:
    """``--program-param KEY=VALUE`` for each of `params`, as a shell takes them: a string as it
    is where the command would read it back as that string, else JSON."""
    import shlex

    def text(value: Any) -> str:
        if isinstance(value, str):
            try:
                json.loads(value)
            except json.JSONDecodeError:
                return value
        return json.dumps(value)

    return " ".join(f"--program-param {shlex.quote(f'{k}={text(v)}')}" for k, v in params.items())


def check_restore(meta: dict | None, given: ProgramParams, job: str, step: int) -> None:
    """Refuse to resume job `job` from its `step` (whose metadata is `meta`) with program params
    other than the ones it was trained with. A checkpoint that recorded none (written before
    program params were recorded) is not checked.

    Raises:
        ProgramParamsMismatchError: naming each key that differs (saved vs given) and the fix.
    """
    if not meta or META_KEY not in meta:
        return
    saved = ProgramParams.from_meta(meta[META_KEY])
    diffs = differences(saved, given)
    if not diffs:
        return
    if saved.type_name != given.type_name and not set(saved.compared()) & set(given.compared()):
        # No field in common: another program than the job's, not other values of its params.
        raise ProgramParamsMismatchError(
            f"job {job!r} was trained to step {step} by a program with {_takes(saved)}, and the "
            f"program given takes {_takes(given)}: it is not the program the job was trained with "
            f"(--program){_or_since(saved, given)}; nothing was restored or trained. Give the "
            "job's own program (`prefect-jax status` shows the params of its newest step), or "
            "train this one under a new job name"
        )
    listed = "; ".join(f"{k}: saved {s!r}, given {g!r}" for k, s, g in diffs)
    to_give = _params_to_give(saved, given, diffs)
    same = f"{_as_flags(to_give)}; a flow's program_params {json.dumps(to_give)}" if to_give else ""
    added = [k for k, s, _ in diffs if s == UNSET]
    removed = [k for k, _, g in diffs if g == UNSET]
    notes = ""
    if added:
        notes += (
            f"; {', '.join(added)} did not exist when step {step} was saved: given its default, "
            "it counts as what that step ran with (a field without a default cannot)"
        )
    if removed:
        notes += (
            f"; {', '.join(removed)} is no longer a field of the params type: step {step} was "
            "trained with the value above, which the program can no longer be given"
        )
    raise ProgramParamsMismatchError(
        f"job {job!r} was trained to step {step} with other program params than the ones given "
        f"({listed}); nothing was restored or trained. Resume it with the same params"
        f"{f' ({same})' if same else ''}, or train the new params under a new job name{notes}"
    )


def _takes(params: ProgramParams) -> str:
    """What a program's params are, for a refusal that tells two programs apart."""
    if params.type_name is None and not params.values:
        return "no program params"
    fields = sorted(params.compared())
    shown = ", ".join(fields[:8]) + (f", ... ({len(fields) - 8} more)" if len(fields) > 8 else "")
    return f"program params {params.type_name or ''} ({shown})".replace("  ", " ")


def _or_since(saved: ProgramParams, given: ProgramParams) -> str:
    """Where one side has no params type: the job's own program may have gained or lost it."""
    if saved.type_name is None or given.type_name is None:
        return ", or its params type was added or removed since"
    return ""
