"""The job's trainer for a task run: the live one of this process (`prefect_jax.training.live`),
announcing each committed checkpoint as a Prefect event, and for the restore task with the job's
lease taken before JAX starts."""

from __future__ import annotations

import functools
import inspect

from prefect_jax.tasks import notices
from prefect_jax.tasks.events import job_resource
from prefect_jax.tasks.runs import current_flow_run_tags
from prefect_jax.training.names import CHECKPOINT_EVENT, EVENT_STEP_LABEL, FLOW_RUN_ID_TAG
from prefect_jax.training.preemption import deliver_lost_notices
from prefect_jax.training.specs import JobConfig

# A SIGTERM whose handler's exception Python drops is sent again. Here, at import: a worker's flow
# run (these flows', or a user's own of these tasks) loads its flow before Prefect's engine puts
# its SIGTERM bridge in place.
deliver_lost_notices()


def take_the_lease_before_jax(config: JobConfig):
    """Before this process starts JAX, in a flow run of one JAX process: take the job's lease
    (`lease_early.take_early`; the trainer made next adopts it) and return it, or None (no flow
    run, a trainer of the job is live here already, or the job has several JAX processes, whose
    process 0 takes it once JAX has joined them). If another live process on this host trains
    the job for this same flow run (Prefect started the run twice), this waits for it to end
    first (`Lease.wait_for_duplicate`), without JAX: on a GPU that process holds the device's
    memory. Taken this early, the lease also makes a second start of this flow run that comes
    while this process is still starting up wait before its own JAX start, not after it."""
    import sys

    from prefect_jax.training.cluster import from_env, joined
    from prefect_jax.training.live import live_trainer
    from prefect_jax.training.storage import JobStorage

    run_id = current_flow_run_tags().get(FLOW_RUN_ID_TAG)
    if not run_id or live_trainer(config) is not None:
        return None
    try:
        if from_env() is not None:
            return None
    except ValueError:  # a malformed cluster: the trainer's own start names the variable
        return None
    # Asked without importing jax or starting its backend (a GPU's memory). Another thread's
    # import may be under way (a sweep's trials on a threaded task runner): its partial module
    # has no `distributed` yet, and nobody has joined processes through it.
    distributed = getattr(sys.modules.get("jax"), "distributed", None)
    if joined() is not None or getattr(distributed, "is_initialized", lambda: False)():
        return None  # the caller joined processes itself
    from prefect_jax.training.lease_early import take_early
    from prefect_jax.training.preflight import storage_errors

    storage = JobStorage(config.storage, config.job, config.storage_options)
    # As the trainer does first: a refused write is named as such, not as the lease's; an
    # unknown protocol or a missing bucket is one line naming the fix, as the command's.
    with storage_errors(storage, config.storage_name or config.storage, "storage"):
        storage.check_writable()
    return take_early(storage, run_id, config.train.lease_timeout_secs)


def trainer_holding_the_lease(config: JobConfig):
    """The job's trainer for the restore task, its lease taken before JAX started (see
    `take_the_lease_before_jax`); a lease so taken is given back if making the trainer fails."""
    lease = None
    try:
        lease = take_the_lease_before_jax(config)
        return task_trainer(config)
    except BaseException:
        from prefect_jax.training.lease_early import release_early
        from prefect_jax.training.storage import JobStorage

        try:  # (a lease in the registry that `lease` does not name yet: a signal came in between)
            job_dir = JobStorage(config.storage, config.job, config.storage_options).job_dir
        except Exception:  # noqa: BLE001 - the storage itself is what failed: nothing was taken
            job_dir = None
        release_early(job_dir, lease)
        raise


class OnTrainerThread:
    """A live trainer whose methods run on the process's trainer thread, the caller waiting where
    Prefect's SIGTERM bridge raises (`prefect_jax.tasks.notices.call`); its other attributes are
    the trainer's own."""

    def __init__(self, trainer):
        self.trainer = trainer

    def __getattr__(self, name: str):
        value = getattr(self.trainer, name)
        if not inspect.ismethod(value):
            return value
        on_its_thread = notices.call if name in _NEVER_CUT else notices.call_cuttable
        return functools.partial(on_its_thread, value)


# What trains, saves or ends the attempt: a notice waits for it to end (the training checkpoints
# the step in flight and ends itself). Any other call (a restore, an evaluation, an export, a
# collective with the other processes) may have the trainer's ending run beside it.
_NEVER_CUT = frozenset({"train_until_checkpoint", "finish", "close"})


def task_trainer(config: JobConfig) -> OnTrainerThread:
    return OnTrainerThread(_live_trainer(config))


def _live_trainer(config: JobConfig):
    from prefect_jax.training import trainer_thread
    from prefect_jax.training.live import get_trainer

    if not trainer_thread.idle(0):  # (a call a notice left running, after Ctrl-C: see get_trainer)
        notices.call(lambda: None)  # its end first, so that it is not closed under that call
    trainer = get_trainer(config, run_tags=current_flow_run_tags())
    if not trainer.job.commit_listeners:
        from prefect.events import emit_event

        resource = job_resource(config)

        def announce(step: int) -> None:  # runs in a background thread once the step is committed
            emit_event(
                event=CHECKPOINT_EVENT,
                resource={**resource, EVENT_STEP_LABEL: str(step)},
                payload={
                    "step": step,
                    "checkpoint_dir": trainer.job.checkpoint_location,
                    "max_steps": config.train.max_steps,
                },
            )

        trainer.job.commit_listeners.append(announce)
    return trainer
