"""The job's tasks with a flow's `RetrySpec` applied (`Task.with_options`)."""

# No `from __future__ import annotations`: see prefect_jax/flows/__init__.py.
import functools
from typing import Any, NamedTuple

from prefect_jax.tasks import (
    evaluate_if_new,
    export,
    recover,
    restore_or_init,
    train_until_checkpoint,
)
from prefect_jax.training.specs import RetrySpec


class JobTasks(NamedTuple):
    """The tasks of a job, each with its retries."""

    restore_or_init: Any
    train_until_checkpoint: Any
    evaluate_if_new: Any
    export: Any
    recover: Any


@functools.lru_cache(maxsize=16)
def job_tasks(spec: RetrySpec | None = None) -> JobTasks:
    """The job's tasks with `spec`'s retries (None: the tasks' own, `RetrySpec()`'s defaults):
    ``retries`` for the training tasks, ``eval_retries`` for evaluation, export and `recover`
    (the evaluator's and the export's), each with ``retry_delay_seconds``. The retry conditions
    stay the tasks' own. One set per spec (the specs are frozen): a flow run asks at every
    interval."""
    spec = spec or RetrySpec()
    delay = spec.retry_delay_seconds
    train, evaluate = spec.retries, spec.eval_retries
    return JobTasks(
        restore_or_init.with_options(retries=train, retry_delay_seconds=delay),
        train_until_checkpoint.with_options(retries=train, retry_delay_seconds=delay),
        evaluate_if_new.with_options(retries=evaluate, retry_delay_seconds=delay),
        export.with_options(retries=evaluate, retry_delay_seconds=delay),
        recover.with_options(retries=evaluate, retry_delay_seconds=delay),
    )
