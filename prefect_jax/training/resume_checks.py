"""What a job's own step is checked for before it is restored to train on: the program params it
was trained with (`program_params.check_restore`), the seed that orders ``train_data(seed)``
and the program's ``data_fingerprint()``, what its data is.

The data iterator's position, restored with the state, is an index into the data: with another
seed, or files that changed under the program, it would go on reading another run's data, and
the resume would not continue the run that stopped (TF's ``CheckpointInputPipelineHook`` restored
the position alone, into whatever files were there). Each refusal names what the step recorded,
what is given now and the fix; nothing is restored or trained. A step that recorded none of these
(saved before they were recorded) is not checked for it.

This module imports neither jax nor prefect.
"""

from __future__ import annotations

from typing import Any

from prefect_jax.training.program_params import ProgramParamsMismatchError, check_restore

DATA_KEY = "data_fingerprint"
"""The step's metadata key for its program's ``data_fingerprint()``."""


class DataChangedError(ProgramParamsMismatchError):
    """The program's data is not the data the job's step was trained on (a ValueError: not
    retried, and the command says it in one line)."""


def data_fingerprint_of(program: Any) -> str | None:
    """The program's ``data_fingerprint()`` as a string (None: it declares none). A program
    whose data are files that can change under it (a corpus folder, shards on a bucket) returns
    a digest of what ``train_data`` and ``eval_data`` read; it is asked at each save, so it
    keeps the answer for the data it built."""
    fingerprint = getattr(program, "data_fingerprint", None)
    if not callable(fingerprint):
        return None
    value = fingerprint()
    return None if value is None else str(value)


def check_seed(meta: dict | None, seed: int | None, job: str, step: int) -> None:
    """Refuse to resume job `job` from its `step` with another ``TrainSpec.seed`` than the one it
    was trained with (`seed` None: this process does not train; a step that recorded none: not
    checked). The data iterator's position is restored into ``train_data(seed)``: with another
    seed it would read other data, and the resume would not be the same run."""
    saved = (meta or {}).get("seed")
    if seed is None or saved is None or saved == seed:
        return
    raise ProgramParamsMismatchError(
        f"job {job!r} was trained to step {step} with seed {saved}, given {seed}: "
        "train_data(seed) orders its data by it, so the resume would read other data than the "
        f"run it continues; nothing was restored or trained. Resume it with --seed {saved} "
        f"(TrainSpec(seed={saved})), or train seed {seed} under a new job name"
    )


def check_data(meta: dict | None, program: Any, job: str, step: int) -> None:
    """Refuse to resume job `job` from its `step` where `program`'s ``data_fingerprint()`` is not
    the one the step recorded (`program` None: this process does not train; a step that recorded
    none, or a program that declares none: not checked, and the program's data not built)."""
    saved = (meta or {}).get(DATA_KEY)
    if program is None or saved is None:
        return
    now = data_fingerprint_of(program)
    if now is None or now == saved:
        return
    raise DataChangedError(
        f"job {job!r} was trained to step {step} on other data than the program reads now (its "
        f"data_fingerprint() was {saved!r}, now {now!r}): the restored input position would "
        "index other records, so the resume would not continue the run that stopped; nothing "
        "was restored or trained. Give the job back the data it was trained on, or train on "
        "this data under a new job name (from scratch, or from the job's step with "
        "--checkpoint-path)"
    )


def check_restore_of(
    step_dir: str,
    meta: dict | None,
    given,
    job: str,
    step: int,
    seed: int | None = None,
    program: Any = None,
) -> None:
    """`program_params.check_restore`, `check_seed` and `check_data` of the step at `step_dir`
    (`seed` and `program` given where this process trains), where a mismatch is first told apart
    from damage: one flipped bit in the metadata reads as other params, so a local step's
    checksums are verified before the refusal (`CorruptCheckpointError`: the step is moved aside
    and the job falls back, as for any damaged step). Costs nothing when they agree."""
    try:
        check_restore(meta, given, job, step)
        check_seed(meta, seed, job, step)
        check_data(meta, program, job, step)
    except ProgramParamsMismatchError:
        if "://" not in step_dir:
            from prefect_jax.training.checksums import verify_manifest

            verify_manifest(step_dir)
        raise
