"""The specs' common ground: the frozen pydantic base and the checks that name the fix.

`prefect_jax.training.specs` (the job, train, checkpoint and retry specs) and
`prefect_jax.training.eval_specs` (evaluation, exporters, early stopping) both build on it.

This module imports neither jax nor prefect.
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing

from pydantic import BaseModel, ConfigDict, model_validator

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_name(kind: str, value: str) -> str:
    """Refuse names that would escape their directory (``..``, ``/``, absolute paths).

    Args:
        kind: what the name is, for the message (``"job"``, ``"eval name"``).
        value: the name.

    Returns:
        The name, unchanged.

    Raises:
        ValueError: the name is empty, contains a path separator, is ``.`` or ``..``, or
            uses characters outside ``[A-Za-z0-9_.-]``.
    """
    if (
        not isinstance(value, str)
        or not _NAME_RE.match(value)
        or value in (".", "..")
        or ".." in value
    ):
        raise ValueError(
            f"{kind} {value!r} is not a valid name: use 1-128 characters from [A-Za-z0-9_.-], "
            "starting with a letter or digit, with no '..' and no path separators "
            f"(for example {kind.split()[0]}-1)."
        )
    return value


class Spec(BaseModel):
    """Base of every spec: unknown fields are refused, naming the nearest known one; a number
    is neither NaN, nor infinite, nor a bool (pydantic's lax mode reads True as 1); a spec
    never changes once built."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _known_fields_and_no_bool_numbers(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        for name, value in data.items():
            if name not in fields and isinstance(name, str):
                near = difflib.get_close_matches(name, list(fields), n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise ValueError(
                    f"{cls.__name__} has no field {name!r}: {hint}its fields are "
                    f"{', '.join(fields)}"
                )
            if isinstance(value, bool) and _is_number(fields[name].annotation):
                raise ValueError(
                    f"{name}={value!r} is a bool, where {cls.__name__}.{name} takes a number: "
                    "give the number"
                )
        return data


def _is_number(annotation) -> bool:
    """An int or float field (or one of those or None) that takes no bool."""
    if typing.get_origin(annotation) not in (None, typing.Union, types.UnionType):
        return False  # (a list[int], a dict[str, float]: not a number)
    kinds = typing.get_args(annotation) or (annotation,)
    return bool not in kinds and any(kind in (int, float) for kind in kinds)


def positive(field: str, value, fix: str, allow_none: bool = False):
    """Refuse a value that is not a positive, finite number, naming the field, the value and
    `fix`."""
    if value is None and allow_none:
        return value
    if value is None or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{field}={value!r} must be a positive number; {fix}")
    return value


__all__ = ["Spec", "check_name", "positive"]
