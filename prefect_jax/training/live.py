"""The trainers alive in this process, one per job: how a flow run's tasks share the live state.

Tasks pass small references (a `JobConfig`, a step), never arrays; the train state stays here
between the tasks of one flow run, so an interval does not re-read the checkpoint it just
wrote. A retry, a rerun or another process restores from storage instead.

Importing this module does not import jax: a flow's state hook may look here (`finish_live`)
in a process that never trained.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect_jax.training.errors import JobTrainedHereError, LeaseLostError
from prefect_jax.training.specs import JobConfig
from prefect_jax.training.storage import JobStorage

if TYPE_CHECKING:
    from prefect_jax.training.trainer import Trainer

_live: dict[str, Trainer] = {}


def _key(config: JobConfig) -> str:
    return JobStorage(config.storage, config.job).job_dir


def get_trainer(config: JobConfig, run_tags: dict[str, str] | None = None) -> Trainer:
    """The live Trainer of this job in this process, or a new one (with no state yet).

    A cached trainer is reused only if its config is identical and Ctrl-C did not end it
    (`ended_on_ctrl_c`: the new one restores the step it checkpointed); otherwise it is closed
    and replaced.
    """
    key = _key(config)
    trainer = _live.get(key)
    if trainer is not None and trainer.config == config and not ended_on_ctrl_c(trainer):
        if run_tags:
            trainer.job.run_tags.update(run_tags)
        return trainer
    if trainer is not None:
        other = _flow_run_training(trainer, run_tags)
        if other is not None:  # (closing it would end that run's training under it)
            raise JobTrainedHereError(key, other)
        del _live[key]  # (closed: never handed out again, even if the new one is refused)
        trainer.close()
    from prefect_jax.training.trainer import Trainer

    trainer = Trainer(config, run_tags=run_tags)
    _live[key] = trainer
    return trainer


def _flow_run_training(trainer: Trainer, run_tags: dict[str, str] | None) -> str | None:
    """The flow run other than the caller's (`run_tags`) whose training holds `trainer`'s lease,
    or None (the lease let go: its run ended, as `finish_live` ends it)."""
    from prefect_jax.training.names import FLOW_RUN_ID_TAG

    mine = (run_tags or {}).get(FLOW_RUN_ID_TAG)
    theirs = trainer.job.run_tags.get(FLOW_RUN_ID_TAG)
    held = trainer.job.lease.held
    return theirs if held and mine and theirs and mine != theirs else None


def ended_on_ctrl_c(trainer: Trainer) -> bool:
    """Whether `trainer` ended its attempt on Ctrl-C (SIGINT): its step in flight checkpointed,
    the `KeyboardInterrupt` raised to the caller, who may run the job again in this process (a
    notebook, as after an interrupted Keras ``fit``). A trainer ended by a SIGTERM refuses to go
    on (`AttemptEnd.stop_if_preempted`): its process is going."""
    import signal

    ended = trainer.ending.preempted
    return ended is not None and ended[2] == signal.SIGINT


def live_trainer(config: JobConfig) -> Trainer | None:
    """This job's live Trainer in this process, if there is one (never creates one)."""
    return _live.get(_key(config))


def live_trainers() -> list[Trainer]:
    """Every live Trainer of this process."""
    return list(_live.values())


def finish_live(config: JobConfig, status: str) -> bool:
    """If this process trains the job (its trainer holds the lease, or is one of several processes
    other than process 0): let a checkpoint in flight commit, close the MLflow run with `status`,
    free the lease. True if it did."""
    trainer = live_trainer(config)
    # Never touch a job another trainer holds. A process other than process 0 of several holds
    # no lease: it finishes its own part (its saves in flight, its SIGTERM guard).
    if trainer is None or (trainer.job.is_primary and not trainer.job.lease.held):
        return False
    try:
        trainer.job.verify_lease()  # held, as far as this process knew: still?
    except LeaseLostError:
        return False
    trainer.finish(status)
    return True


def land_mlflow_writes(config: JobConfig) -> None:
    """Wait until the MLflow writes this job's live trainer has made so far have landed (eval
    metrics, model versions): an evaluate or export flow run ends only then, as a train flow run
    ends once `Trainer.finish` has closed its run. Up to `mlflow_client.EXIT_WAIT_SECS`, then a
    warning (`Tracker.land`); in strict mode, until they land, raising the first that failed."""
    trainer = live_trainer(config)
    if trainer is not None:
        trainer.job.tracker.land()


def release_state(config: JobConfig) -> None:
    """Free this job's live state in this process, if any (`Trainer.release_state`): an evaluate
    or export flow run ends with it, as a train flow run's `Trainer.finish` does."""
    trainer = live_trainer(config)
    if trainer is not None and trainer.recovered:  # (never a state this process trains)
        trainer.release_state()


def drop_trainer(config: JobConfig) -> None:
    """Forget (and close) this job's live trainer."""
    trainer = _live.pop(_key(config), None)
    if trainer is not None:
        trainer.close()


def drop_all(close: bool = True) -> None:
    """Forget every live trainer of this process (closing them, unless `close` is False: as if
    this process had never trained)."""
    while _live:
        _, trainer = _live.popitem()
        if close:
            trainer.close()
