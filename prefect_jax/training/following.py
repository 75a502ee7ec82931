"""What the roles that do not train (the evaluator, the exporter) take from their trainer, as
recorded in the job's newest committed step: its ``max_steps``, and the program params that
trainer was given, under any the role is given itself.

TF's roles run one program with one set of flags, so they share one TrainSpec and one model
config. Here each role is its own command, flow run or deployment: an evaluator given another
``max_steps`` waited for a final step that never came (or took a middle one for final), and one
given no ``--program-param`` built the default model and was refused on restore until every
param was repeated. Params given to a role are still its own: the restore compares them with
the step's and refuses a difference (`program_params.check_restore`). Exempt params (a mesh) are
never taken: an evaluator on fewer devices than its trainer picks its own.

This module imports neither jax nor prefect.
"""

from __future__ import annotations

from typing import Any

from prefect_jax.training.program_params import META_KEY, ProgramParams


def trainers_max_steps(meta: dict | None, given: int | None) -> int | None:
    """The max_steps the step's trainer recorded; `given` where the step records none (saved
    before max_steps was recorded, or unreadable)."""
    if meta is None or "max_steps" not in meta:
        return given
    return meta["max_steps"]


def trainers_program_params(
    meta: dict | None, given: dict[str, Any] | None
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``(params, taken)``: the program params the step's trainer was given, with `given` (this
    role's own) on top; and those taken from the step. Not taken: the fields the engine fills
    (``max_steps``: filled again here) and those the type exempts from the restore check (a mesh,
    reading threads: this role's machine's, which may have fewer devices than the trainer's). A
    step that records no params, or not which were given (saved before that was recorded),
    leaves `given` as it is."""
    if meta is None or META_KEY not in meta:
        return given, {}
    saved = ProgramParams.from_meta(meta[META_KEY])
    if saved.given is None:
        return given, {}
    skip = set(saved.filled) | set(saved.exempt) | set(given or {})
    taken = {k: saved.values[k] for k in saved.given if k in saved.values and k not in skip}
    return ({**taken, **given} if given is not None else taken or None), taken
