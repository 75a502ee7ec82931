"""A committed step that fails to restore: the step's own damage, or a cause that is the run's.

`session.recover_session` (TF's `SessionManager`) tries the job's committed steps newest first. A
step that is damaged is set aside and the one before it tried: a kill tears the newest step, not
the ones before it. A failure whose cause is the run's (device memory, the machine's libraries or
storage, another layout of processes, a lost peer) would meet every older step too, and passing
over them all would set the job's progress aside and start it again from scratch. Such a failure
is raised, and nothing is set aside, where it is

- known to be the run's (`not_the_steps_fault`): the step's files match its checksums
  (`IntactStepRestoreError`, from `Checkpoints.restore`), the storage did not answer or refused the
  credentials, the machine ran out of memory, another process of the job went away;
- met the same way by the step before it (`fails_alike`), where nothing tells;
- met by every step, none before them restored to tell, unless each was found damaged by its
  checksums (`CorruptCheckpointError`).

A step that failed is set aside once an older one restores, or where its checksums found it
damaged. A failure that is raised names the newest step not found damaged: the step the next run
resumes from. Where every step was found damaged, each is set aside and the caller inits.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable

from prefect_jax.training.checksums import CorruptCheckpointError
from prefect_jax.training.cluster import lost_a_process
from prefect_jax.training.errors import (
    CheckpointMismatchError,
    RestoreFailedError,
    and_its_causes,
    out_of_memory,
    said,
)
from prefect_jax.training.following import trainers_program_params
from prefect_jax.training.program_params import META_KEY
from prefect_jax.training.remote_errors import RemoteStorageError

logger = logging.getLogger("prefect_jax.trainer")


def not_the_steps_fault(exc: BaseException) -> bool:
    """Whether a failed restore says nothing against the step (see the module)."""
    if isinstance(exc, (RestoreFailedError, RemoteStorageError)) or out_of_memory(exc):
        return True
    if lost_a_process(exc):  # (a collective's error: another process's cause)
        return True
    # XLA's or a storage's other exhausted resources (a rate limit), however wrapped
    return any(str(e).startswith("RESOURCE_EXHAUSTED") for e in and_its_causes(exc))


def fails_alike(newer: BaseException, older: BaseException) -> bool:
    """Whether two committed steps in a row failed to restore the same way: the same error type,
    neither found damaged by its checksums (damage is each step's own)."""
    return type(newer) is type(older) and not isinstance(newer, CorruptCheckpointError)


class RestoreFailures:
    """The steps of `directory` that failed to restore so far, newest first; `on_unreadable(step,
    error)` sets one aside (None: nothing is, as for an evaluator)."""

    def __init__(self, directory: str, on_unreadable: Callable[[int, BaseException], None] | None):
        self.directory, self.on_unreadable = directory, on_unreadable
        self.failed: list[tuple[int, BaseException]] = []

    def add(self, step: int, exc: BaseException) -> None:
        """`step` failed with `exc` (not the run's by `not_the_steps_fault`): the one before it is
        tried next.

        Raises:
            RestoreFailedError: the step after it failed the same way (`fails_alike`).
        """
        if self.failed and fails_alike(self.failed[-1][1], exc):
            why = f"step {step} before it failed the same way: the cause is the run's"
            raise self._the_runs(why) from exc
        logger.warning(
            "checkpoint step %d in %s is unreadable (%s); falling back to the previous committed "
            "step",
            step,
            self.directory,
            said(exc),
        )
        self.failed.append((step, exc))

    def set_aside(self) -> None:
        """An older step restored: the ones that failed were theirs to blame."""
        for step, exc in self.failed if self.on_unreadable is not None else ():
            self.on_unreadable(step, exc)

    def none_restored(self) -> None:
        """No step restored: each is set aside where its checksums found it damaged (the caller
        then inits), else none is.

        Raises:
            RestoreFailedError: a step failed and nothing tells whose fault it is.
        """
        if self.failed and not all(isinstance(e, CorruptCheckpointError) for _, e in self.failed):
            raise self._the_runs("no step before it restored to tell whose fault it is")
        self.set_aside()

    def _the_runs(self, why: str) -> RestoreFailedError:
        """The error to raise for the newest step that failed without its checksums finding it
        damaged (the step the next run resumes from); those they found damaged are set aside."""
        damaged = [(s, e) for s, e in self.failed if isinstance(e, CorruptCheckpointError)]
        for step, exc in damaged if self.on_unreadable is not None else ():
            self.on_unreadable(step, exc)
        step, exc = next(
            (s, e) for s, e in self.failed if not isinstance(e, CorruptCheckpointError)
        )
        return RestoreFailedError(f"{self.directory}/{step}", exc, why)


def _written_by(source, step: int) -> str:
    """``" by program P with program params {...}"`` as step `step` of `source` (its job's
    `Checkpoints`) records them; "" where it records no program or cannot be read."""
    try:
        meta = source.read_meta(int(step))
    except Exception:  # noqa: BLE001 - read again by the restore just now: only the hint is lost
        meta = {}
    if not meta.get("program"):
        return ""
    taken = trainers_program_params(meta, None)[1]  # (the params its trainer was given)
    if taken:
        params = f" with program params {json.dumps(taken, sort_keys=True)}"
    else:
        params = " with its program's default params" if META_KEY in meta else ""
    return f" by program {meta['program']}{params}"


def job_step_mismatch(source, step: int, mismatch: CheckpointMismatchError) -> str | None:
    """Why the job's step `step` (of `source`, its `Checkpoints`) was refused, naming the program
    and params that wrote it (an evaluator given another program than its trainer's said only
    that "the program changed"); then the differing leaves. None where the step records no
    program, or the refusal lists no leaves (its data position's): `mismatch` says it all."""
    by = _written_by(source, step)
    if not by or not mismatch.leaves:
        return None
    return (
        f"step {step} of this job was written{by}, and this run's program builds another state "
        "(the leaves below differ): run it with the program and params that wrote it (an "
        "evaluator or an export: its trainer's), or start a new job (a different job name or "
        f"storage).\n{mismatch.leaves}"
    )


def warm_start_mismatch(path: str, source, mismatch: CheckpointMismatchError) -> str:
    """Why the warm start from step `path` (of `source`, its job's `Checkpoints`) was refused:
    another model's state; the program and the params its job was given, where it records them,
    so that the same model can be built; then the differing leaves. (A new job: the advice to
    restore with the program that wrote it, or to start a new job, was beside the point.)"""
    by = _written_by(source, int(os.path.basename(path)))
    return (
        f"checkpoint_path {path} (a warm start) holds another model's state than this job's "
        f"program builds: it was trained{by}. "
        "Warm-start from a step of the same model, or build this one as that step's was "
        f"(--program-param KEY=VALUE).{chr(10) + mismatch.leaves if mismatch.leaves else ''}"
    )
