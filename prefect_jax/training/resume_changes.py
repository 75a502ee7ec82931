"""What a resumed job changes against its newest step's record, said before it trains on.

Three changes a rerun can make without meaning to, all accepted as TF accepts them, all warned of
here (`warn_of_changes`, from the trainer's restore):

- **Another program or config** with the same state tree (``mymod:fast`` for the job's
  ``digits:tiny``, another learning rate in the program's ``config``): the state restores and
  trains on under the new program, as a TF model_dir restores into any graph with the same
  variables. Program params are checked and refused elsewhere (`program_params.check_restore`);
  the program's path and its config's fingerprint are only recorded, so they are compared here.
- **Another max_steps, filled into the program's params** (`_warn_of_refilled_params`): not
  compared on restore, so a job extended from 200 to 300 steps stretches a cosine decay tied to
  it, its learning rate jumping at step 200.
- **A retention that keeps fewer steps.** TF's `CheckpointManager` (and its `Saver`),
  restarted with a smaller ``max_to_keep``, deletes the older checkpoints at its next save
  without a word, and so does Orbax: a job trained with ``--keep-last 10`` and resumed without
  the flag (the default keeps 3) loses 7 steps. Each step records the retention it was saved
  with (`recorded_retention`); a trainer resumed with one that would delete steps the recorded
  one keeps names them and the flags that keep them, before its first save
  (`warn_if_retention_narrowed`). The two retentions are compared over the same steps, so
  nothing is said where the steps are as the recorded one left them plus what it would delete
  anyway (a process killed between a commit and its deletions leaves one more step)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from prefect_jax.training.policy import retained
from prefect_jax.training.program import program_fingerprint
from prefect_jax.training.program_params import META_KEY, ProgramParams
from prefect_jax.training.specs import CheckpointSpec

logger = logging.getLogger("prefect_jax.trainer")

# The CheckpointSpec fields that decide which regular steps are kept, and their flags
_RETENTION_FLAGS = {
    "keep_last": "--keep-last",
    "keep_every_steps": "--keep-every-steps",
    "keep_every_secs": "--keep-every-secs",
}


def recorded_retention(spec: CheckpointSpec) -> dict[str, Any]:
    """What a step's metadata records of the retention it was saved with."""
    return {field: getattr(spec, field) for field in _RETENTION_FLAGS}


def deleted_by_the_change(
    steps: list[int],
    recorded: dict[str, Any],
    spec: CheckpointSpec,
    newest_evaluated: int | None,
    is_backup: Callable[[int], bool],
    saved_at: Callable[[int], float | None],
) -> list[int]:
    """The committed `steps` (oldest first) that `spec`'s retention deletes at the next save and
    the `recorded` one keeps: retention as it runs once one more regular step commits."""
    if not steps:
        return []
    following = steps[-1] + 1
    after = [*steps, following]

    def backup(s: int) -> bool:
        return s != following and is_backup(s)

    def at(s: int) -> float | None:
        return time.time() if s == following else saved_at(s)

    before = spec.model_copy(update={k: v for k, v in recorded.items() if k in _RETENTION_FLAGS})
    kept_before = retained(after, before, newest_evaluated, backup, at)
    kept_now = retained(after, spec, newest_evaluated, backup, at)
    return sorted((kept_before - kept_now) & set(steps))


def warn_of_changes(
    job, config, program: Any, meta: dict | None, step: int, params: ProgramParams | None = None
) -> None:
    """Warn of what this run changes against `meta`, the metadata of the job's newest step
    `step` it restored (None: a new job or a warm start, nothing to compare): its program (path
    `config.program`, the loaded `program`'s config), the program params the engine fills
    (`params`: the program's now) and its retention. `job` is the trainer's `Job`; said by the
    primary process only, and only where the job trains on. A warning only: whatever goes wrong
    in looking (the storage, a damaged record) is logged, not raised."""
    if meta is None or not job.is_primary or config.train.is_final(step):
        return
    try:
        _warn_of_another_program(config, program, meta, step)
        _warn_of_refilled_params(config, params, meta, step)
        warn_if_retention_narrowed(job, config, meta, step)
    except Exception:  # noqa: BLE001 - the resume goes on: the changes are the user's to judge
        logger.warning(
            "job %s: not compared with step %d's record", config.job, step, exc_info=True
        )


def _warn_of_another_program(config, program: Any, meta: dict, step: int) -> None:
    was, was_fingerprint = meta.get("program"), meta.get("program_fingerprint")
    if was is not None and was != config.program:
        logger.warning(
            "job %s: step %d was trained by program %s, and this run's is %s: it trains on from "
            "the restored state with this program (its state tree is the same). If that is not "
            "meant, stop it and give the job's program again (--program %s), or train this one "
            "under a new job name",
            config.job,
            step,
            was,
            config.program,
            was,
        )
        return
    # A program with a params type: its params are checked (`program_params.check_restore`), and
    # its config follows them and what they exempt (a filled max_steps, reading threads). A
    # config that is not JSON is fingerprinted by repr, which differs in every process.
    typed = (meta.get("program_params") or {}).get("type") is not None
    if typed or was_fingerprint is None:
        return
    try:
        json.dumps(getattr(program, "config", None))
    except (TypeError, ValueError):
        return
    fingerprint = program_fingerprint(config.program, program)
    if was_fingerprint != fingerprint:
        logger.warning(
            "job %s: program %s's config differs from the one step %d was trained with "
            "(fingerprint %s, now %s): it trains on from the restored state with the new config. "
            "If that is not meant, stop it and give the program its old config, or train it "
            "under a new job name",
            config.job,
            config.program,
            step,
            was_fingerprint,
            fingerprint,
        )


def _warn_of_refilled_params(config, params: ProgramParams | None, meta: dict, step: int) -> None:
    """A field the engine fills from the job (``max_steps``) is not compared on restore: resumed
    to another max_steps, a schedule the program ties to it (a learning-rate decay's horizon)
    changes from `step` on, the rate jumping there. Said, with the param that keeps it."""
    recorded = meta.get(META_KEY)
    if params is None or not isinstance(recorded, dict):
        return
    saved = ProgramParams.from_meta(recorded)
    for field in saved.filled:  # (filled then; now filled again, or left None: trained forever)
        was, now = saved.values.get(field), params.values.get(field)
        if field in (params.given or ()) or was == now:
            continue  # (given now: compared on restore like any other field)
        logger.warning(
            "job %s: program param %s was filled with %s (the job's max_steps) when step %d was "
            "saved, and is %s now: a schedule the program ties to it (a learning-rate decay's "
            "horizon) changes from step %d on, as asked. To keep the one it trained with, give "
            "--program-param %s=%s (a flow's program_params {%s: %s})",
            config.job,
            field,
            was,
            step,
            now,
            step,
            field,
            json.dumps(was),
            json.dumps(field),
            json.dumps(was),
        )


def warn_if_retention_narrowed(job, config, meta: dict, step: int) -> None:
    """Warn where the job's next save deletes committed steps that the retention recorded in
    `meta` (its newest step's, `step`) keeps: `job` is the trainer's `Job`, `config` its
    `JobConfig` (asked by `warn_of_changes`, which says who and when). Steps saved before
    retention was recorded are not compared."""
    spec, recorded = config.checkpoint, meta.get("retention")
    if not isinstance(recorded, dict):
        return
    if recorded == recorded_retention(spec):
        return
    deleted = deleted_by_the_change(job.committed_steps(), recorded, spec, *job.retention_reads())
    if not deleted:
        return
    differ = {f: was for f, was in recorded.items() if f in _RETENTION_FLAGS}
    differ = {f: was for f, was in differ.items() if was != getattr(spec, f)}
    changed = {f: was for f, was in differ.items() if _keeps_more(f, was, getattr(spec, f))}
    changed = changed or differ  # (each narrower alone, or only together)
    flags = " ".join(
        f"{_RETENTION_FLAGS[field]} {'none' if was is None else was}"
        for field, was in changed.items()
    )
    fields = ", ".join(f"{field}={was!r}" for field, was in changed.items())
    now = ", ".join(f"{field}={getattr(spec, field)!r}" for field in changed)
    shown = ", ".join(map(str, deleted[:10])) + (" ..." if len(deleted) > 10 else "")
    logger.warning(
        "job %s: its step %d was saved keeping %s, and this run keeps %s: its next checkpoint "
        "deletes %d committed steps the job's retention kept (%s), and later checkpoints more, "
        "as TF's CheckpointManager restarted with a smaller max_to_keep would. To keep them, "
        "stop it before that save and give %s again (CheckpointSpec(%s))",
        job.config.job,
        step,
        fields,
        now,
        len(deleted),
        shown,
        flags,
        fields,
    )


def _keeps_more(field: str, was, now) -> bool:
    """Whether the recorded value `was` of a retention field keeps steps that `now` does not:
    part of the fix to name (a larger keep_last, or an added keep_every_*, keeps more now)."""
    if was is None:
        return field == "keep_last" and now is not None  # (None: keep every step)
    if now is None:
        return field != "keep_last"
    if field == "keep_last":
        return was > now
    if field == "keep_every_steps":  # (the multiples of `was` are all kept where `now` divides it)
        return was % now != 0
    return was < now  # keep_every_secs: a longer window keeps fewer
