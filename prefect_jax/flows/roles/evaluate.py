"""The `evaluate` flow: the continuous evaluator role, over `prefect_jax.training.evaluator`."""

# No `from __future__ import annotations`: see prefect_jax/flows/__init__.py.
from typing import Any

from prefect import flow, get_run_logger

from prefect_jax.flows.config import (
    PeriodSecs,
    ProgramPath,
    WaitSecs,
    checked_job_config,
    following_the_trainer,
)
from prefect_jax.flows.retry_options import job_tasks
from prefect_jax.flows.tags import flow_body
from prefect_jax.tasks import publisher
from prefect_jax.tasks.live_trainer import OnTrainerThread
from prefect_jax.tasks.runs import link_live_job
from prefect_jax.training.specs import (
    EVAL_POLL_SECS,
    FIRST_CHECKPOINT_WAIT_SECS,
    CheckpointSpec,
    EvalSpec,
    RetrySpec,
    TrainSpec,
)


@flow(name="evaluate", flow_run_name="evaluate-{job}", validate_parameters=True)
@flow_body
def evaluate(
    program: ProgramPath,
    job: str,
    storage: str,
    train_spec: TrainSpec,
    eval_spec: EvalSpec = EvalSpec(),
    checkpoint_spec: CheckpointSpec = CheckpointSpec(),
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str | None = None,
    compilation_cache_dir: str | None = None,
    every_checkpoint: bool = True,
    once: bool = False,
    wait_for_first_checkpoint_secs: WaitSecs = FIRST_CHECKPOINT_WAIT_SECS,
    poll_secs: PeriodSecs = EVAL_POLL_SECS,
    idle_timeout_secs: WaitSecs | None = None,
    retry_spec: RetrySpec = RetrySpec(),
    program_params: dict[str, Any] | None = None,
    mlflow_optional: bool = False,
) -> dict[str, Any]:
    """The continuous evaluator role (TF's evaluator task), on the same job as a `train` run.

    Waits `eval_spec.start_delay_secs`; waits for the job's first committed checkpoint up to
    `wait_for_first_checkpoint_secs` (TF's `wait_for_session`, reading the storage only) and
    recovers it (the `recover` task, TF's `recover_session`: never an init), or fails with a clear
    error; evaluates every newly committed step exactly once (or only the newest, with
    `every_checkpoint=False`), never sooner than `eval_spec.throttle_secs` after the last
    evaluation; runs the exporters after each evaluation; stops once it has evaluated a step
    at or past its trainer's `max_steps` (recorded in each step; `train_spec.max_steps` only
    where a step records none), with the final export (never where it is None: a job that trains
    until stopped has no final step), when an eval hook asks the job to stop,
    when `once` is set and nothing new is left, or after `idle_timeout_secs` without a new
    checkpoint while no trainer holds the job's lease (a live trainer is waited for: one
    event-triggered run keeps up with it, checking for new steps every `poll_secs`). Evaluated
    steps are recorded durably under ``<job>/evals/<name>/``, so a restarted evaluator never
    evaluates a step twice. The other parameters are `train_and_evaluate`'s.

    Returns:
        ``job``, ``evaluated`` (steps evaluated by this run), ``last_step``, ``eval`` (its
        metrics), ``stopped`` (why), ``exports``, ``registry_missing`` (exports MLflow did not
        take as versions, and the command that registers them; or None).

    Example:
        ```python
        from prefect_jax.flows import evaluate
        from prefect_jax.training.specs import TrainSpec

        # Beside a `train` run of the same job and storage:
        result = evaluate(
            program="prefect_jax.examples.digits:tiny",
            job="tiny",
            storage="/tmp/prefect-jax",
            train_spec=TrainSpec(max_steps=40),
            once=True,
        )
        print(result["evaluated"], result["stopped"])
        ```
    """
    from prefect_jax.training.evaluator import Evaluator
    from prefect_jax.training.exporters import list_exports

    logger = get_run_logger()
    config = checked_job_config(locals())  # its MLflow URI checked before any work
    tasks = job_tasks(config.retry)

    def following():
        """The job's config with the max_steps its trainer recorded in its newest step (a rerun
        of the trainer may have raised it since: an older step records the old one): the
        evaluator's final step, and the final exporter's."""
        nonlocal config
        newest = max(evaluator.committed_steps(), default=None)
        if newest is not None:
            config = following_the_trainer(
                config, evaluator.storage, newest, "evaluator", logger.info
            )
            evaluator.max_steps = config.train.max_steps  # (`export` below reads `config` as is)
        return config

    evaluator = Evaluator.for_job(
        config,
        evaluate=lambda step: tasks.evaluate_if_new(following(), step, force=True),
        export=lambda result: tasks.export(config, result),
        every_checkpoint=every_checkpoint,
        once=once,
        wait_for_first_checkpoint_secs=wait_for_first_checkpoint_secs,
        poll_secs=poll_secs,
        idle_timeout_secs=idle_timeout_secs,
        log=logger.info,
        warn=logger.warning,
    )
    # The wait reads the storage only: JAX (and a GPU) is not taken until there is a step.
    first = evaluator.wait_for_first_checkpoint()  # (the newest committed step)
    following()
    # A late checkpoint event's run finds the job finished and exported: nothing is evaluated or
    # re-exported, but what an evaluator killed earlier left out of MLflow still lands.
    done = _finished_and_exported(config, evaluator)
    # TF's evaluator recovers, never inits (`recover_session`): the step found is restored.
    if not tasks.recover(config, step=first, evaluates=True)["restored"]:
        raise RuntimeError(
            f"step {first} of job {job!r} was committed when the evaluator found it, and could "
            "not be recovered (retention removed it since, or it is damaged: the log above says "
            "which): nothing was evaluated; run the evaluator again"
        )
    from prefect_jax.training.live import (
        get_trainer,
        land_mlflow_writes,
        live_trainer,
        release_state,
    )

    # An evaluator killed after writing eval records may not have logged them to MLflow yet.
    checked = OnTrainerThread(get_trainer(config)).reconcile_eval_metrics(first)
    logger.info("checked %d recorded evaluations against MLflow", checked)
    link_live_job(config)  # (its MLflow run is joined by now)
    if done is not None:
        stopped = evaluator.stopped = f"{done}; nothing to do: its exports are written"
    else:
        evaluator.resume_exports()
        stopped = evaluator.run()
    land_mlflow_writes(config)
    live = live_trainer(config)  # (the evaluator's, which exported: a fresh one ran no MLflow)
    registry_missing = live.exports.registry_missing() if live is not None else None
    release_state(config)
    publisher.flush()
    logger.info("evaluator of %s stops: %s", job, stopped)
    exports = list_exports(evaluator.storage)
    return {
        "job": job,
        **evaluator.summary(),
        "exports": exports,
        "registry_missing": registry_missing,
    }


def _finished_and_exported(config, evaluator) -> str | None:
    """Why the job needs no evaluator any more (its final step evaluated, or it was asked to stop)
    where every exporter has written what it would for the newest evaluation; else None. Read from
    the storage only."""
    from prefect_jax.training import exporters as exp

    (reason, last_first), steps = evaluator.stop_reason(), evaluator.records.steps()
    if reason is None or not steps:
        return None
    if last_first and (evaluator.pending_steps() or evaluator.trainer_alive()):
        return None  # its trainer's last checkpoint evaluated by the run first (waited for)
    newest = evaluator.records.get(steps[-1])
    if newest is None:  # damaged (moved aside): the normal run evaluates that step again
        return None
    for exporter in config.eval.exporters:
        if steps[-1] not in exp.exported_steps(evaluator.storage, exporter.name) and not (
            exp.exports_nothing(exporter, evaluator.storage, newest, config.train.max_steps)
        ):
            return None
    return reason
