"""The `train_until_checkpoint` task: one checkpoint interval of training."""

from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from prefect_jax.tasks.live_trainer import task_trainer
from prefect_jax.tasks.retries import DEFAULT_RETRIES, retry_if_transient
from prefect_jax.tasks.runs import mark_taken_over
from prefect_jax.training.policy import NO_END, CheckpointPolicy
from prefect_jax.training.progress import progress_heard_here
from prefect_jax.training.specs import JobConfig


def _train_run_name() -> str:
    params = task_run.parameters
    config, start = params["config"], params["from_step"]
    if isinstance(config, dict):
        config = JobConfig.model_validate(config)
    policy = CheckpointPolicy.for_training(config.checkpoint, config.train.max_steps)
    end = _end_step(policy, start)
    # (no arrow between the steps: the run graph drops it, showing "train 200400")
    return f"train {start} to {end}" if end else f"train from {start}"


def _end_step(policy: CheckpointPolicy, start: int) -> int | None:
    """The step an interval from `start` ends at; None without max_steps and with a time-only
    cadence, where its checkpoint's time ends it."""
    end = policy.next_boundary(start)
    return None if end == NO_END else end


@task(
    name="train_until_checkpoint",
    task_run_name=_train_run_name,
    cache_policy=NO_CACHE,
    retries=DEFAULT_RETRIES.retries,
    retry_delay_seconds=DEFAULT_RETRIES.retry_delay_seconds,
    retry_condition_fn=retry_if_transient,
)
def train_until_checkpoint(config: JobConfig, from_step: int) -> int:
    """Train from `from_step` to the next checkpoint boundary and save (asynchronously).

    If this process does not hold the live state at `from_step` (a retry after a failure,
    another worker), the newest committed checkpoint is restored first. Transient failures
    (I/O, preemption) are retried from there; permanent ones (a bad program, a shape
    mismatch, a NaN/Inf loss, a job leased by another trainer) fail at once.

    Args:
        config: the job.
        from_step: the step the caller believes the job is at (what the previous task returned).

    Returns:
        The step reached (and checkpointed).

    Example:
        ```python
        from prefect import flow
        from prefect_jax.tasks import restore_or_init, train_until_checkpoint
        from prefect_jax.training.specs import CheckpointSpec, JobConfig, TrainSpec

        @flow
        def train_tiny():
            config = JobConfig(program="prefect_jax.examples.digits:tiny", job="tiny",
                               storage="/tmp/prefect-jax", train=TrainSpec(max_steps=20),
                               checkpoint=CheckpointSpec(every_steps=10))
            step = restore_or_init(config)["step"]
            while step < config.train.max_steps:
                step = train_until_checkpoint(config, step)
            return step

        train_tiny()
        ```
    """
    logger = get_run_logger()
    trainer = task_trainer(config)
    stop = trainer.stop_requested()
    if stop is not None:
        logger.warning("not training: the job was asked to stop (%s)", stop.get("reason"))
        return from_step
    if trainer.state is None or trainer.step != from_step:
        restored = trainer.restore_or_init()
        mark_taken_over(trainer)
        logger.info(
            "live state not at step %d here: restored step %d from storage", from_step, restored
        )
    end = _end_step(trainer.policy, trainer.step)
    logger.info(
        "training from step %d %s",
        trainer.step,
        f"to {end}" if end else "until the time-only cadence's checkpoint",
    )
    # (this job's lines only: another job's task may wait on this process's trainer thread)
    with progress_heard_here(progress_lines(logger.info, until=end)):
        step = trainer.train_until_checkpoint()
    # (the save commits in the background: a kill before that resumes from the step before)
    logger.info(
        "step %d trained, its checkpoint saving (%s)", step, _shown(trainer.last_train_metrics)
    )
    return step


PROGRESS_LINE_SECS = 30.0
"""The least time between two of an interval's progress lines (TF logged the loss and the steps
per second every `log_step_count_steps`): a job whose checkpoints are minutes apart says how it
goes between them in its run's log, where no progress bar is drawn (a worker, a CI log)."""


def progress_lines(
    log, every_secs: float | None = None, clock=time.monotonic, until: int | None = None
):
    """A progress listener (`progress_heard_here`) that logs the step and its log point's
    means and throughput with `log`, at the first log point `every_secs` (default
    `PROGRESS_LINE_SECS`) after the interval's start or the line before; not at step `until`
    (the interval's end, which its task's own line tells). The metrics of a log point it does
    not log stay on the device."""
    every = PROGRESS_LINE_SECS if every_secs is None else every_secs
    last = clock()

    def heard(step: int, max_steps: int | None, metrics: dict) -> None:
        nonlocal last
        if clock() - last < every or (until is not None and step >= until):
            return
        last = clock()
        of = f" of {max_steps}" if max_steps else ""
        log("step %d%s: %s", step, of, _shown(metrics))

    return heard


def _shown(metrics: dict) -> str:
    return ", ".join(f"{k}={float(v):.4g}" for k, v in sorted(metrics.items()))
