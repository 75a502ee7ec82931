"""A program's parameter type, looked at: which factories take one (a pydantic model or a
dataclass), its fields' annotations, type names, defaults and whether a field takes a boolean.
`program_params` validates, records and compares the values; this module only describes the type.

This module imports neither jax nor prefect.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import types
import typing
from typing import Any


def _unwrap_optional(tp):
    """``X | None`` (or ``Optional[X]``) as ``X``; any other type as it is."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else None
    return tp


def _is_params_type(tp) -> bool:
    if not isinstance(tp, type):
        return False
    if dataclasses.is_dataclass(tp):
        return True
    try:
        from pydantic import BaseModel
    except ImportError:  # pragma: no cover - pydantic is a dependency
        return False
    return issubclass(tp, BaseModel)


def params_type(factory: Any) -> type | None:
    """The parameter type of a program factory: the annotation of its one parameter (or of its
    first, if the others have defaults) when that is a pydantic model or a dataclass (``X | None``
    counts as ``X``); None for anything else."""
    if not callable(factory):
        return None
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        signature = inspect.signature(factory)
        hints = typing.get_type_hints(target)
    except (TypeError, ValueError, NameError):
        return None
    params = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if not params or any(p.default is p.empty for p in params[1:]):
        return None
    tp = _unwrap_optional(hints.get(params[0].name))
    return tp if _is_params_type(tp) else None


def field_annotations(tp: type, metadata: bool = False) -> dict[str, Any]:
    """``{field: its annotation}`` of a pydantic model or a dataclass, in declaration order;
    with `metadata`, as ``Annotated`` with what the field declares beside its type (its own
    validators, constraints), so that validating against it is validating the field."""
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp, include_extras=metadata)
        return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(tp)}
    return {
        name: typing.Annotated[(f.annotation, *f.metadata)]
        if metadata and f.metadata
        else f.annotation
        for name, f in tp.model_fields.items()
    }


def field_types(tp: type) -> dict[str, str]:
    """``{field: "its type"}`` of a pydantic model or a dataclass, in declaration order."""
    return {name: _type_text(t) for name, t in field_annotations(tp).items()}


def takes_a_boolean(annotation: Any) -> bool:
    """Whether a field of type `annotation` (with its metadata: `field_annotations`) takes True
    or False: as they are, or through a validator of its own. Pydantic's lax validation turns
    them into 1 and 0 for a number (``--program-param dropout=true`` would train with dropout
    1.0); a type it cannot check counts as taking them. A model's ``field_validator`` is not
    seen here."""
    from pydantic import TypeAdapter, ValidationError

    try:
        adapter = TypeAdapter(annotation)
    except Exception:  # noqa: BLE001 - not a type pydantic builds: its own validation decides
        return True
    try:
        adapter.validate_python(True, strict=True)
        return True
    except ValidationError:
        return False
    except Exception:  # noqa: BLE001 - a validator of its own that fails otherwise
        return True


def field_defaults(tp: type) -> dict[str, Any]:
    """``{field: its default, JSON-able}`` of each field of `tp` that has a default (a factory's
    value included), dumped as the recorded values are (a model's field serializers applied, so
    that a field at its default compares equal); a default that cannot be made alone (a pydantic
    factory that reads the other fields) or does not dump to JSON is left out: such a field is
    compared as before (present on one side only, it differs)."""
    from pydantic import TypeAdapter

    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        found = {}
        for f in dataclasses.fields(tp):
            if f.default is not dataclasses.MISSING:
                found[f.name] = (hints.get(f.name, f.type), lambda f=f: f.default)
            elif f.default_factory is not dataclasses.MISSING:
                found[f.name] = (hints.get(f.name, f.type), f.default_factory)
    else:
        found = {
            name: (f.annotation, lambda f=f: f.get_default(call_default_factory=True))
            for name, f in tp.model_fields.items()
            if not f.is_required()
        }
    out = {}
    for name, (annotation, make) in found.items():
        try:
            default, value = make(), None
            if not dataclasses.is_dataclass(tp):
                # as the recorded values are dumped: through the model's field serializers
                with contextlib.suppress(Exception):  # (a model serializer of its own)
                    value = tp.model_construct(**{name: default}).model_dump(
                        mode="json", include={name}
                    )[name]
            if value is None:
                value = TypeAdapter(annotation).dump_python(default, mode="json")
            out[name] = json.loads(json.dumps(value))
        except Exception:  # noqa: BLE001 - compared as a field without a default
            continue
    return out


def _type_text(tp) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def describe_fields(tp: type) -> str:
    """``"name: type, ..."`` of every field of `tp`, for error messages."""
    return ", ".join(f"{name}: {text}" for name, text in field_types(tp).items())
