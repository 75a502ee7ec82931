"""The specs' common ground: the frozen pydantic base and the checks that name the fix.

`prefect_jax.training.specs` (the job, train, checkpoint and retry specs) and
`prefect_jax.training.eval_specs` (evaluation, exporters, early stopping) both build on it.

This module imports neither jax nor prefect.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

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
    """Base of every spec: unknown fields are refused and a spec never changes once built."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def positive(field: str, value, fix: str, allow_none: bool = False):
    """Refuse a value that is not a positive number, naming the field, the value and `fix`."""
    if value is None and allow_none:
        return value
    if value is None or value <= 0:
        raise ValueError(f"{field}={value!r} must be a positive number; {fix}")
    return value


__all__ = ["Spec", "check_name", "positive"]
