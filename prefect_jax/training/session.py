"""TF's `SessionManager` for a JAX train state: `prepare_session` (restore the newest committed
step, or one explicit step, or run init) and `recover_session` (restore only, never init);
optionally wait for a first checkpoint."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefect_jax.training.checkpoint_dirs import (
    committed_steps,
    wait_for_new_checkpoint,
)
from prefect_jax.training.checkpoints import Checkpoints
from prefect_jax.training.checksums import CorruptCheckpointError
from prefect_jax.training.errors import (
    CheckpointMismatchError,
    PastMaxStepsError,
)
from prefect_jax.training.lease import duplicate_wait_ended
from prefect_jax.training.names import DEVICES_TAG
from prefect_jax.training.preflight import check_evaluation
from prefect_jax.training.program_params import ProgramParamsMismatchError
from prefect_jax.training.progress import notify_progress
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.restore_failures import RestoreFailures, not_the_steps_fault
from prefect_jax.training.resume_changes import warn_of_changes
from prefect_jax.training.resume_checks import (
    DataFingerprintError,
    asked_once,
    check_restore_of,
    check_warm_start,
    fetch_and_check,
    raising_its_own,
)
from prefect_jax.training.sharded_state import (
    check_train_batch,
    describe_devices,
    warn_of_idle_devices,
)
from prefect_jax.training.specs import MAX_WAIT_SECS, RECOVERY_WAIT_SECS
from prefect_jax.training.steps import step_meta
from prefect_jax.training.storage import normalize_root
from prefect_jax.training.tracking_params import job_params

if TYPE_CHECKING:
    from prefect_jax.training.trainer import Trainer

logger = logging.getLogger("prefect_jax.trainer")


def recover_session(
    checkpoints: Checkpoints | None,
    abstract_state,
    *,
    checkpoint_dir: str | None = None,
    checkpoint_path: str | None = None,
    make_data_iter: Callable[[], Any] | None = None,
    wait_for_checkpoint: bool = False,
    max_wait_secs: float = MAX_WAIT_SECS,
    recovery_wait_secs: float = RECOVERY_WAIT_SECS,
    on_unreadable: Callable[[int, BaseException], None] | None = None,
    list_steps: Callable[[], list[int]] | None = None,
    prepare_step: Callable[[int], None] | None = None,
    log: Callable[[str], None] = logger.info,
) -> tuple[bool, Any, int | None, dict | None, Any]:
    """`SessionManager.recover_session` for a JAX train state: restore, never init.

    Restores the latest readable committed step under `checkpoint_dir`, or the one step at
    `checkpoint_path`, as `restore_or_init` does; where there is none (after waiting up to
    `max_wait_secs` with `wait_for_checkpoint`), builds nothing and says so: TF's
    ``(sess, False)``. The arguments are `restore_or_init`'s.

    Returns:
        (restored, state, step, metadata, data iterator): ``(False, None, None, None, None)``
        where nothing was restored.

    Raises:
        ValueError: both `checkpoint_dir` and `checkpoint_path` were given, or
            `checkpoint_path` is not a committed step directory.
        CheckpointMismatchError: the checkpoint's tree differs from `abstract_state`.
        RestoreFailedError: a step failed for a cause that is the run's (`restore_failures`).
    """
    new_iter = make_data_iter or (lambda: None)
    if checkpoint_dir and checkpoint_path:
        raise ValueError(
            f"both checkpoint_dir={checkpoint_dir!r} and checkpoint_path={checkpoint_path!r} were "
            "given: pass checkpoint_dir to resume from its latest checkpoint, or checkpoint_path "
            "to restore one step, not both"
        )
    if checkpoint_path:
        path = normalize_root(checkpoint_path)  # (a local one absolute: Orbax takes no other)
        parent, name = os.path.split(path)
        if not name.isdigit() or int(name) not in committed_steps(parent):
            raise ValueError(
                f"checkpoint_path={checkpoint_path!r} is not a committed checkpoint step "
                f"directory; committed steps in {parent!r}: {committed_steps(parent)}. Point it at "
                "'<checkpoints>/<step>'."
            )
        source = Checkpoints(parent, read_only=True)
        try:  # (not its data position: the source job's, of a train_data that may differ)
            state, meta = source.restore(int(name), abstract_state, None)
        except CheckpointMismatchError as exc:
            from prefect_jax.training.restore_failures import warm_start_mismatch

            raise CheckpointMismatchError(warm_start_mismatch(path, source, exc)) from exc
        finally:
            source.close()
        log(f"restored step {name} from {path}")
        return True, state, int(name), meta, new_iter()
    if checkpoint_dir:
        assert checkpoints is not None and checkpoints.directory == checkpoint_dir
        list_steps = list_steps or checkpoints.committed_steps
        if not list_steps() and wait_for_checkpoint:
            wait_for_new_checkpoint(list_steps, None, max_wait_secs, recovery_wait_secs, log)
        failures = RestoreFailures(checkpoint_dir, on_unreadable)
        for step in reversed(list_steps()):
            data_iter = new_iter()
            try:
                if prepare_step is not None:
                    prepare_step(step)
                state, meta = checkpoints.restore(step, abstract_state, data_iter)
            except CheckpointMismatchError as exc:
                from prefect_jax.training.restore_failures import job_step_mismatch

                said = job_step_mismatch(checkpoints, step, exc)
                if said is None:
                    raise
                raise CheckpointMismatchError(said, leaves=exc.leaves) from exc
            except (ProgramParamsMismatchError, DataFingerprintError):
                raise
            except Exception as exc:  # noqa: BLE001 - a damaged step: fall back to the one before
                if not_the_steps_fault(exc):
                    raise
                failures.add(step, exc)  # (raises where the step before fails the same way)
                continue
            failures.set_aside()
            log(f"restored step {step} from {checkpoint_dir}")
            return True, state, step, meta, data_iter
        failures.none_restored()  # (raises unless each was found damaged: init follows)
    return False, None, None, None, None


def restore_or_init(
    checkpoints: Checkpoints | None,
    init: Callable[[], Any],
    abstract_state,
    *,
    checkpoint_dir: str | None = None,
    checkpoint_path: str | None = None,
    make_data_iter: Callable[[], Any] | None = None,
    wait_for_checkpoint: bool = False,
    max_wait_secs: float = MAX_WAIT_SECS,
    recovery_wait_secs: float = RECOVERY_WAIT_SECS,
    on_unreadable: Callable[[int, BaseException], None] | None = None,
    list_steps: Callable[[], list[int]] | None = None,
    prepare_step: Callable[[int], None] | None = None,
    log: Callable[[str], None] = logger.info,
) -> tuple[Any, int, dict | None, Any]:
    """`SessionManager.prepare_session` for a JAX train state: `recover_session`, else init.

    Restores the latest committed step under `checkpoint_dir`, or the one step at
    `checkpoint_path`; with neither (or nothing committed yet), runs `init`. A newest step
    that cannot be read (truncated or missing files) is skipped with a warning naming it,
    and the committed step before it is tried: partial state is never restored. A failure that
    says nothing against the step (`not_the_steps_fault`: out of memory, storage unreachable, its
    files intact) is raised instead: no step is passed over for it.

    Args:
        checkpoints: the job's `Checkpoints` (used for `checkpoint_dir`).
        init: builds a fresh state.
        abstract_state: ``jax.eval_shape`` of `init`: the structure a restore must match.
        checkpoint_dir: restore the latest committed step in this directory.
        checkpoint_path: restore exactly this step directory (``.../checkpoints/<step>``).
        make_data_iter: builds a fresh Grain iterator whose position is restored with the state.
        wait_for_checkpoint: if no committed step exists yet, wait for one.
        max_wait_secs: how long to wait.
        recovery_wait_secs: how often to look while waiting.
        on_unreadable: called with (step, error) for each step skipped as unreadable.
        list_steps: the committed steps (default: those in `checkpoint_dir`; remote storage
            lists its own).
        prepare_step: makes a step readable in `checkpoint_dir` before its restore (remote
            storage downloads it).

    Returns:
        (state, step, metadata of the restored checkpoint or None after init, data iterator or
        None).

    Raises:
        ValueError: both `checkpoint_dir` and `checkpoint_path` were given, or
            `checkpoint_path` is not a committed step directory.
        CheckpointMismatchError: the checkpoint's tree differs from `abstract_state`.
    """
    restored, state, step, meta, data_iter = recover_session(
        checkpoints,
        abstract_state,
        checkpoint_dir=checkpoint_dir,
        checkpoint_path=checkpoint_path,
        make_data_iter=make_data_iter,
        wait_for_checkpoint=wait_for_checkpoint,
        max_wait_secs=max_wait_secs,
        recovery_wait_secs=recovery_wait_secs,
        on_unreadable=on_unreadable,
        list_steps=list_steps,
        prepare_step=prepare_step,
        log=log,
    )
    if restored:
        return state, step, meta, data_iter
    if checkpoint_dir:
        log(f"no committed checkpoint in {checkpoint_dir}: initialising from scratch")
    return init(), 0, None, (make_data_iter or (lambda: None))()


# -- a trainer's restore -------------------------------------------------------------


def restore_trainer(
    trainer: Trainer,
    checkpoint_path: str | None,
    wait_for_checkpoint: bool,
    max_wait_secs: float,
    recovery_wait_secs: float,
    evaluates: bool = True,
) -> int:
    """`Trainer.restore_or_init`: the job's lease, then its live state (restored or made by init)
    in `trainer`, its MLflow run attached, its attempt opened in the goodput ledger."""
    trainer.ending.stop_if_preempted()
    trainer.forget_stop_answer()  # (a restore may land on the step last asked at: ask again)
    trainer.exports.prunes_once_registered = False  # (a trainer's: while it holds the lease)
    job, loop = trainer.job, trainer.loop
    check_train_batch(loop)
    job.goodput.restore_began()
    job.checkpoints.wait()
    newest, max_steps = job.newest_committed(), trainer.config.train.max_steps
    if newest is not None and max_steps is not None and newest > max_steps:
        # another program's job is said as such first, from the step's metadata (no download)
        remote = job.remote is not None
        where = job.storage.remote_checkpoint_url if remote else job.checkpoints.directory
        with contextlib.suppress(CorruptCheckpointError):  # (damage, not params: past it anyway)
            params, name = trainer.program_params, trainer.config.job
            check_restore_of(
                f"{where}/{newest}", step_meta(job.storage, newest), params, name, newest
            )
        raise PastMaxStepsError(redact_url(job.storage.job_dir), newest, max_steps)
    if newest is None and checkpoint_path:
        check_warm_start(job.storage.job_dir, checkpoint_path, max_steps)
    if not evaluates:  # the train role (its retries' restores too): its evaluator checks them
        trainer.metrics_settled = True
    elif newest is None and not trainer.metrics_settled and job.processes == 1:
        # a new job no command checked (a flow or the engine from Python): before any step
        check_evaluation(trainer.program, trainer.config.eval, flags=False)
        trainer.metrics_settled = True  # (checked, or knowable only as it evaluates)
    waited_for_holder = job.acquire_lease(recheck=True)
    # (a holder waited for may have committed meanwhile: its progress is not a rerun without any;
    # listed again only then, not on every restore: a listing of object storage)
    started_at = job.newest_committed() if waited_for_holder else newest
    if not trainer.config.train.is_final(started_at):
        # Counted before the restore: a rerun that dies restoring (out of memory, a bad mount)
        # spends the budget too, so a crash automation cannot rerun it forever.
        job.record_attempt(
            started_at or 0,
            lambda: job_params(trainer.config, trainer.program, trainer.program_params),
        )
    waited = duplicate_wait_ended(job.storage.job_dir)
    # another process of this flow run trained until then: not this attempt's time
    if waited is not None:
        job.goodput.restart_clock(waited)
    trainer.guard.install()
    trainer.wait_for_compile_cache()
    if not trainer.config.train.is_final(started_at):
        # (a finished job's rerun trains no step, and its end would wait for that compile; a
        # holder waited for may have committed the final step)
        loop.start_precompile()
    # (remote: the committed steps, listed once for the restore below)
    listed = job.prepare_restore()
    has_own = bool(listed if listed is not None else job.committed_steps())

    # what the trainer reads next, compared with its step's (its data asked where a step has one)
    reads = dict(seed=trainer.config.train.seed, data=asked_once(trainer.program))
    # (refused for its input, not counted: the budget is for crashes and kills)
    with job.uncounted_if(CheckpointMismatchError, ProgramParamsMismatchError), raising_its_own():
        state, step, meta, data_iter = restore_or_init(
            job.checkpoints,
            loop.init_state,
            loop.abstract_state,
            checkpoint_dir=job.checkpoints.directory if (has_own or not checkpoint_path) else None,
            checkpoint_path=None if has_own else checkpoint_path,
            make_data_iter=loop.fresh_iter,
            wait_for_checkpoint=wait_for_checkpoint,
            max_wait_secs=max_wait_secs,
            recovery_wait_secs=recovery_wait_secs,
            on_unreadable=job.set_aside,
            # (none yet: a wait for one lists again)
            list_steps=(lambda: listed) if listed else job.committed_steps,
            prepare_step=lambda at: fetch_and_check(trainer, at, reads),
        )
    # (a warm start: weights from elsewhere, this job's data from the start, `prepare_session`'s)
    if checkpoint_path and has_own:  # (TF's prepare_session refuses both; a rerun must resume)
        logger.warning(
            "job %s has checkpoints of its own: it resumes from step %d, and checkpoint_path %s "
            "(a warm start for a new job) is not used; give a new job name to warm-start from it",
            trainer.config.job,
            step,
            redact_url(checkpoint_path),
        )
    # A warm start's step is another job's: its MLflow run and train metrics are that job's.
    own = meta if has_own else None
    job.discard_records_after(step)
    warn_of_changes(job, trainer.config, trainer.program, own, step, trainer.program_params)
    # Attach to MLflow first, so that a refusal below still closes the run as FAILED.
    job.attach_tracking(
        job_params(trainer.config, trainer.program, trainer.program_params),
        (own or {}).get("mlflow_run_id"),
    )
    # The restored interval's train metrics, in case its process died before writing them.
    trainer.intervals.log_train_rows([tuple(r) for r in (own or {}).get("train_metrics", [])])
    if not trainer.config.train.is_final(step):  # what this attempt trains on
        trainer.trains_on = describe_devices(loop.mesh if loop.sharded else None)
        warn_of_idle_devices(trainer.program)
        if job.is_primary:  # (for the MLflow run's reader too)
            job.tracker.set_tags({DEVICES_TAG: trainer.trains_on})
    trainer.state, trainer.step, trainer.data_iter = loop.place(state), step, data_iter
    loop.means.carry(step, (meta or {}).get("train_sums"))  # the means resume where they were
    trainer.live_is_preemption = bool((meta or {}).get("preemption"))
    trainer.recovered = False
    trainer.started_from = step  # committed, or init / a warm start: a rerun gets the same state
    trainer.warm_started = bool(checkpoint_path and not has_own and step)
    job.goodput.begin(step)
    notify_progress(step, trainer.config.train.max_steps, {})
    return step


def recover_trainer(
    trainer: Trainer,
    step: int | None,
    wait_for_checkpoint: bool,
    max_wait_secs: float,
    recovery_wait_secs: float,
    evaluates: bool = False,
) -> tuple[bool, int | None]:
    """`Trainer.recover`: the job's committed `step` (None: its newest readable one) as the
    trainer's live state, for evaluation and export; never init, never the lease, MLflow or the
    goodput ledger (those are the job's writer's): it runs beside the job's trainer.

    With `wait_for_checkpoint`, waits up to `max_wait_secs` for a first committed step, looking
    every `recovery_wait_secs`. A trainer that has a live state already (it trains the job in
    this process) keeps it: it is returned when it is the step asked for, else the answer is
    whether that step is committed (its evaluation or export restores it). A recovered state
    cannot be trained on: `restore_or_init` first."""
    trainer.ending.stop_if_preempted()
    trainer.exports.prunes_once_registered = evaluates  # (see there)
    job, loop = trainer.job, trainer.loop
    if trainer.state is not None and (step is None or step == trainer.step):
        # this process holds the job's state already (local mode: the trainer's own)
        return True, trainer.step
    if trainer.state is not None and not trainer.recovered:
        # a training state is not swapped for an older step: an evaluation restores it itself
        return job.is_committed(step), step
    job.checkpoints.wait()
    if evaluates and not trainer.metrics_settled and job.processes == 1:
        # the evaluate flow, before it restores a step (once per trainer)
        check_evaluation(trainer.program, trainer.config.eval, flags=False)
        trainer.metrics_settled = True
    if step is not None:
        if not job.is_committed(step):
            return False, None
        list_steps = lambda: [step]  # noqa: E731 - that one step, no fallback to another
    else:
        list_steps = job.committed_steps
    restored, state, at, meta, _ = recover_session(
        job.checkpoints,
        loop.abstract_state,
        checkpoint_dir=job.checkpoints.directory,
        wait_for_checkpoint=wait_for_checkpoint,
        max_wait_secs=max_wait_secs,
        recovery_wait_secs=recovery_wait_secs,
        list_steps=list_steps,
        # (the evaluator and export roles too: other params evaluate and export another model)
        prepare_step=lambda at: fetch_and_check(trainer, at),
    )
    if not restored:
        where = redact_url(job.storage.remote_checkpoint_url or job.storage.checkpoint_dir)
        logger.info("no committed checkpoint in %s: nothing recovered, nothing initialised", where)
        return False, None
    # no data iterator: a recovered state is evaluated and exported, never trained on
    trainer.state, trainer.step, trainer.data_iter = loop.place(state), at, None
    trainer.recovered = True
    trainer.live_is_preemption = bool((meta or {}).get("preemption"))
    trainer.started_from = at
    return True, at
