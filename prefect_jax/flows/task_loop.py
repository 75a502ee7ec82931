"""The training loop the `train_and_evaluate` and `train` flows share, and their summary."""

# No `from __future__ import annotations`: see prefect_jax/flows/__init__.py.
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import TerminationSignal

from prefect_jax.flows import progress_card
from prefect_jax.flows.hooks import publish_goodput
from prefect_jax.flows.retry_options import job_tasks
from prefect_jax.tasks import notices, publisher
from prefect_jax.tasks.live_trainer import OnTrainerThread
from prefect_jax.training.specs import JobConfig


def _evaluate_and_export(config: JobConfig, step: int, last: bool, on_new=None) -> bool:
    """Evaluate and export `step`; whether evaluation goes on (an eval listener may stop it).
    `last`: the job was asked to stop, so `step` is its last: evaluated whatever the throttle,
    as TF's local mode evaluates its last checkpoint at the end. `on_new()` is called when `step`
    was evaluated now (not found evaluated already)."""
    from prefect_jax.training.evaluation import EvalStatus

    tasks = job_tasks(config.retry)
    result = tasks.evaluate_if_new(config, step, force=last)
    if on_new is not None and result.status is EvalStatus.EVALUATED:
        on_new()
    # no task run per interval for exporters that are not there, nor for nothing evaluated
    if config.eval.exporters and result.status not in (
        EvalStatus.EVALUATION_STOPPED,
        EvalStatus.OTHER_PROCESS,  # (its gather for the export was joined in the evaluation)
    ):
        # lowered and written while the next interval trains (joined before the next export
        # and at the job's end, which fail if it failed)
        tasks.export(config, result, background=True)
    if result.evaluation_stopped:
        # A listener ends the evaluations, not the job: training goes on to max_steps, as the
        # trainer does beside an evaluator that stopped (should_stop_job stops the job).
        get_run_logger().warning(
            "%s; job %s trains on to max_steps=%s without evaluating or exporting",
            result.evaluation_stopped,
            config.job,
            config.train.max_steps,
        )
        return False
    return True


def train_loop(config: JobConfig, step: int, evaluate: bool) -> tuple[int, str | None]:
    """Train (and, in local mode, evaluate and export) until max_steps or a stop request."""
    from prefect_jax.training.control import asked_by_an_evaluation
    from prefect_jax.training.live import get_trainer

    max_steps = config.train.max_steps
    train_until_checkpoint = job_tasks(config.retry).train_until_checkpoint
    trainer = OnTrainerThread(get_trainer(config))
    # The live trainer's view of a stop request: with several processes, process 0's, in all of
    # them.
    stop_requested = trainer.stop_requested
    # With several processes, process 0 evaluates and exports: no task runs elsewhere that only
    # say so; but a state sharded over them is evaluated by all (`training.collective`).
    evaluate = evaluate and (trainer.job.is_primary or trainer.loop.spans)
    trainer.evaluations.of_live_steps = evaluate
    # Made and updated on the publisher's thread, in order: no HTTP round trip before training;
    # updated at most every PREFECT_JAX_UI_REFRESH_SECS, and at the end.
    shown: dict[str, Any] = {}
    key = progress_card.progress_key()
    publisher.submit(progress_card.start_progress, shown, step, max_steps, config.job)
    last_eval = None  # the latest evaluation this loop made, shown on the progress card
    named: list[bool] = []  # MLflow's "Prefect flow run" names this one (once it did something)

    def name_this_flow_run() -> None:  # (a no-op run of a finished job leaves the one that did)
        if not named:
            named.append(True)
            trainer.job.name_this_flow_run()

    # A crash between a checkpoint and its evaluation leaves that step unevaluated. Not a warm
    # start's step, which is another job's model (TF evaluates none before the run's own first
    # checkpoint): it would become this job's first export and registered version, and its best.
    # (asked in every process: with several, a collective)
    stopped = stop_requested() is not None
    if evaluate and step > 0 and not (trainer.warm_started and not config.train.is_final(step)):
        evaluate = _evaluate_and_export(config, step, stopped, on_new=name_this_flow_run)
    try:
        trained = False
        while not config.train.is_final(step):  # (max_steps None: until a stop request)
            stop = stop_requested()
            if stop is not None:
                if not trained:  # asked before this run: a rerun alone never trains on
                    _say_stopped_before(trainer, step, stop)
                elif evaluate and not stopped and not asked_by_an_evaluation(stop):
                    # asked while `step` was evaluated (maybe throttled): it is the job's last
                    _evaluate_and_export(config, step, last=True)
                return step, stop.get("reason")
            trained = True
            name_this_flow_run()
            step = train_until_checkpoint(config, step)
            stopped = stop_requested() is not None  # (a train hook's, a person's: the last step)
            if evaluate:
                evaluate = _evaluate_and_export(config, step, stopped)
                # (no read of the storage: the live step's record is written once it commits)
                last_eval = trainer.job.records.newest_known() or last_eval
            metrics = progress_card.shown_metrics(
                trainer.last_train_metrics, last_eval.metrics if last_eval else {}, config.eval.name
            )
            publisher.refresh(
                key, progress_card.update_progress, shown, step, max_steps, config.job, metrics
            )
        stop = stop_requested()
        return step, stop.get("reason") if stop else None
    except BaseException as exc:
        notices.end_if_notice(exc)  # (a notice between task runs: before the flush below waits)
        if isinstance(notices.the_notice(exc), TerminationSignal):
            publisher.hurry()  # the process is going: its flushes wait a round trip at most
        raise
    finally:
        publisher.flush()


def _say_stopped_before(trainer, step: int, stop: dict) -> None:
    from prefect_jax.training.control import stop_path
    from prefect_jax.training.redaction import redact_url

    get_run_logger().warning(
        "job %s was asked to stop before this run (at step %s, by %s: %s): nothing trained. "
        "Delete %s to train it on from step %d",
        trainer.config.job,
        stop.get("step"),
        stop.get("by") or "a person",
        stop.get("reason"),
        redact_url(stop_path(trainer.job.storage)),
        step,
    )


def job_summary(config: JobConfig, stopped: str | None, evaluates: bool = False) -> dict[str, Any]:
    """Close the job's run (MLflow, the lease), publish its goodput, and say where it ended.

    `evaluates` (local mode): a job that trained to max_steps without being stopped must have its
    final step evaluated (unless an eval listener ended the evaluations), else
    `FinalEvaluationMissingError` (before the run is closed: the flow fails, and its failure hook
    closes the MLflow run as FAILED)."""
    from prefect_jax.training.errors import FinalEvaluationMissingError
    from prefect_jax.training.exporters import list_exports
    from prefect_jax.training.live import get_trainer

    trainer = OnTrainerThread(get_trainer(config))
    if trainer.state is None:
        trainer.restore_or_init()
    # First: a collective where the state is sharded over several processes, which every process
    # must reach before anything that fails in process 0 alone (below).
    fingerprint = trainer.fingerprint()
    at_the_end = stopped is None and config.train.is_final(trainer.step)
    if evaluates and at_the_end and trainer.job.is_primary and not trainer.evaluations.stopped:
        # the final step's, once its save commits
        notices.call(trainer.evaluations.pending.record, wait=True)
        if trainer.job.records.get(trainer.step) is None:
            raise FinalEvaluationMissingError(config.job, trainer.step)
    trainer.finish("FINISHED")
    trainer.release_state()  # (its next run restores from storage: no device memory kept)
    publisher.flush()  # the MLflow link, queued once MLflow answered (finish waited for that)
    final = trainer.job.records.get(trainer.step)
    goodput = trainer.goodput()
    if trainer.job.is_primary:  # the others keep no ledger
        publish_goodput(config, goodput)
    return {
        "job": config.job,
        "final_step": trainer.step,
        "eval": final.metrics if final else {},
        # where the steps stay (object storage: not this machine's stage of them)
        "checkpoint_dir": trainer.job.checkpoint_location,
        "mlflow_tracking_uri": trainer.job.tracker.tracking_uri,
        "mlflow_run_id": trainer.job.tracker.run_id,
        "mlflow_run_url": trainer.job.tracker.run_url(),
        "registered_model": trainer.registered_model if config.eval.exporters else None,
        # (a `train` role's trainer exports nothing: what its evaluator exported so far, seen
        # at an arbitrary moment, is the evaluator's summary's and `status`'s to say)
        "exports": list_exports(trainer.job.storage) if evaluates else {},
        "state_fingerprint": fingerprint,
        "stopped": stopped,
        "evaluation_stopped": trainer.evaluations.stopped,
        "goodput": goodput,
        "mlflow_missing": _mlflow_missing(trainer),
        # (a `train` role's trainer exports nothing: its evaluator registers what it exports)
        "registry_missing": trainer.exports.registry_missing() if evaluates else None,
    }


def _mlflow_missing(trainer) -> str | None:
    """What of the job did not reach MLflow, said plainly (None: its run is there). A store that
    never answered (``--mlflow-optional``) has no run of the job at all."""
    tracker = trainer.job.tracker
    if not trainer.job.is_primary or tracker.run_id is not None:
        return None
    from prefect_jax.training.redaction import redact_url

    return (
        f"nothing of this run reached MLflow at {redact_url(tracker.tracking_uri)} (no run, "
        "params, metrics or models there); the job's checkpoints, eval records and exports are "
        "in its storage (prefect-jax status)"
    )
