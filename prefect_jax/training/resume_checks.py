"""A job's own step before it is restored (`fetch_and_check`): fetched from remote storage, and
checked for the program params it was trained with (`program_params.check_restore`) and, where
the restore trains on, the seed that orders ``train_data(seed)`` and the program's
``data_fingerprint()``, what its data is.

The data iterator's position, restored with the state, is an index into the data: with another
seed, or files that changed under the program, it would go on reading another run's data, and
the resume would not continue the run that stopped (TF's ``CheckpointInputPipelineHook`` restored
the position alone, into whatever files were there). Each refusal names what the step recorded,
what is given now and the fix; nothing is restored or trained. A step that recorded none of these
(saved before they were recorded) is not checked for it.

This module imports neither jax nor prefect.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefect_jax.training.checkpoint_dirs import read_meta_file, step_of_dir
from prefect_jax.training.checksums import CorruptCheckpointError
from prefect_jax.training.errors import PastMaxStepsError, RestoreFailedError
from prefect_jax.training.program_params import ProgramParamsMismatchError, check_restore
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.remote_errors import RemoteStorageError

if TYPE_CHECKING:
    from prefect_jax.training.trainer import Trainer

DATA_KEY = "data_fingerprint"
"""The step's metadata key for its program's ``data_fingerprint()``."""


class DataChangedError(ProgramParamsMismatchError):
    """The program's data is not the data the job's step was trained on (a ValueError: not
    retried, and the command says it in one line)."""


class DataFingerprintError(Exception):
    """The program's ``data_fingerprint()`` failed while a step was being restored: the
    program's error (`error`), not damage of the step (the restore passes it on, and the trainer
    raises `error` itself)."""

    def __init__(self, error: BaseException):
        super().__init__(f"data_fingerprint() failed: {error!r}")
        self.error = error


def asked_once(program: Any) -> Callable[[], str | None]:
    """A function that asks `program`'s `data_fingerprint_of` on its first call (only where a
    step to restore recorded one) and keeps the answer; its failure is a `DataFingerprintError`."""
    answer: list[str | None] = []

    def ask() -> str | None:
        if not answer:
            try:
                answer.append(data_fingerprint_of(program))
            except Exception as exc:  # noqa: BLE001 - the program's, passed on as such
                raise DataFingerprintError(exc) from exc
        return answer[0]

    return ask


def data_fingerprint_of(program: Any) -> str | None:
    """The program's ``data_fingerprint()`` as a string (None: it declares none). A program
    whose data are files that can change under it (a corpus folder, shards on a bucket) returns
    a digest of what ``train_data`` and ``eval_data`` read, the same in every process (the whole
    data's, not one process's shard); it is asked at each save, so it keeps the answer for the
    data it built. A restore asks it through `asked_once`: its own failure (a listing that timed
    out) is the program's error, not damage of the step being restored."""
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


def check_data(
    meta: dict | None, ask: Callable[[], str | None] | None, job: str, step: int
) -> None:
    """Refuse to resume job `job` from its `step` where the program's ``data_fingerprint()``,
    as `ask` answers it (asked only where the step recorded one; `ask` None: this process does
    not train; an answer None: the program declares none), is not the one the step recorded."""
    saved = (meta or {}).get(DATA_KEY)
    if saved is None or ask is None:
        return
    now = ask()
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


def check_warm_start(job_dir: str, checkpoint_path: str, max_steps: int | None) -> None:
    """Refuse a new job's warm start from a step past `max_steps` (`PastMaxStepsError`): it keeps
    its step, so the job would train nothing (the command's preflight and the engine ask)."""
    step = step_of_dir(checkpoint_path)
    if step and max_steps is not None and step > max_steps:
        raise PastMaxStepsError(
            redact_url(job_dir), step, max_steps, warm_start=redact_url(checkpoint_path)
        )


def check_restore_of(
    step_dir: str,
    meta: dict | None,
    given,
    job: str,
    step: int,
    seed: int | None = None,
    data: Callable[[], str | None] | None = None,
) -> None:
    """`program_params.check_restore`, `check_seed` and `check_data` of the step at `step_dir`
    (`seed` and `data` given where this process trains; in that order, so that params that
    differ are said before a data that cannot be built), where a mismatch is first told apart
    from damage: one flipped bit in the metadata reads as other params, so a local step's
    checksums are verified before the refusal (`CorruptCheckpointError`: the step is moved aside
    and the job falls back, as for any damaged step). Costs nothing when they agree."""
    try:
        check_restore(meta, given, job, step)
        check_seed(meta, seed, job, step)
        check_data(meta, data, job, step)
    except ProgramParamsMismatchError:
        if "://" not in step_dir:
            from prefect_jax.training.checksums import verify_manifest

            verify_manifest(step_dir)
        raise


def fetch_and_check(trainer: Trainer, step: int, reads: dict | None = None) -> None:
    """Before a step of the job's own is restored: fetched (remote storage), and refused if it was
    trained with other program params, or (`reads`: a trainer's seed and data fingerprint) on
    other data than it will read, unless it trains no more (before its tree is compared: a model
    of another size would be refused for its shapes, not for the params that made them; a flipped
    bit in the recorded params is told apart as damage, `check_restore_of`)."""
    job = trainer.job
    if job.remote is not None:
        try:
            job.fetch(step)
        except (FileNotFoundError, CorruptCheckpointError, RemoteStorageError):
            raise  # (no longer committed there; damaged; the storage's: `not_the_steps_fault`)
        except OSError as exc:  # (a copy cut short or of the wrong size: retried, not passed over)
            why = "its download failed, which says nothing against the step"
            url = f"{redact_url(job.storage.remote_checkpoint_url)}/{step}"
            raise RestoreFailedError(url, exc, why) from exc
    meta = read_meta_file(job.checkpoints.directory, step)
    step_dir = os.path.join(job.checkpoints.directory, str(step))
    reads = reads if reads and not trainer.config.train.is_final(step) else {}
    check_restore_of(step_dir, meta, trainer.program_params, trainer.config.job, step, **reads)


@contextlib.contextmanager
def raising_its_own():
    """Around a restore that asked `asked_once`: its `DataFingerprintError` raised as the
    program's own error."""
    try:
        yield
    except DataFingerprintError as exc:
        raise exc.error from None
