"""Prefect tasks over the engine: restore_or_init, train_until_checkpoint, evaluate_if_new, export.

Each task passes small references (the JSON-able `JobConfig`, a step, an `EvalResult`),
never arrays. The live train state stays in this process between tasks of one flow run
(see `prefect_jax.training.live`); a retry or another process restores
from storage.

Example:
    ```python
    from prefect import flow
    from prefect_jax.tasks import restore_or_init, train_until_checkpoint, evaluate_if_new
    from prefect_jax.training.specs import JobConfig, TrainSpec

    @flow
    def my_loop(config: JobConfig):
        step = restore_or_init(config)["step"]
        while step < config.train.max_steps:
            step = train_until_checkpoint(config, step)
            evaluate_if_new(config, step)
    ```
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import queue
import re
import threading
import time
from typing import Any, Callable

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run

from prefect_jax.training.specs import JobConfig
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.storage import JobStorage


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", "-".join(parts).lower())).strip("-")[:100]


class _Publisher:
    """Prefect API calls that only refresh what people see (artifacts), made in order by one
    background thread, so a training loop never waits on an HTTP round trip for them.

    Each call runs in a copy of the caller's context, so an artifact is still linked to the
    flow and task run that asked for it. Failures are logged, never raised: the UI may lag,
    training does not stop. Flows `flush` before they return.
    """

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="prefect-jax-publish", daemon=True)
                self._thread.start()
        self._queue.put((contextvars.copy_context(), fn, args, kwargs))

    def _work(self) -> None:
        while True:
            context, fn, args, kwargs = self._queue.get()
            try:
                context.run(fn, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the UI may lag; training goes on
                logging.getLogger("prefect_jax.tasks").warning("could not publish %s: %r", getattr(fn, "__name__", fn), exc)
            finally:
                self._queue.task_done()

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every submitted call has run (at most `timeout` seconds); True if all did."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks


publisher = _Publisher()
atexit.register(publisher.flush, 15.0)  # flows flush before returning; this covers tasks used in other flows


def _run_tags() -> dict[str, str]:
    run_id = flow_run.id
    return {"prefect.flow_run_id": str(run_id)} if run_id else {}


CHECKPOINT_EVENT = "prefect-jax.checkpoint.committed"
EVAL_EVENT = "prefect-jax.eval.completed"
EXPORT_EVENT = "prefect-jax.export.completed"


def job_resource(config: JobConfig) -> dict[str, str]:
    """The Prefect event resource of a job: ``prefect-jax.job.<job>``, with its storage as a label."""
    return {
        "prefect.resource.id": f"prefect-jax.job.{config.job}",
        "prefect.resource.name": config.job,
        "prefect-jax.storage": redact_url(JobStorage(config.storage, config.job).root),
    }


def emit(event: str, config: JobConfig, payload: dict[str, Any]) -> None:
    """Emit a prefect-jax event about a job (best effort: an events outage never stops training)."""
    from prefect.events import emit_event

    try:
        emit_event(event=event, resource=job_resource(config), payload=payload)
    except Exception as exc:  # noqa: BLE001
        get_run_logger().warning("could not emit %s: %r", event, exc)


def _trainer(config: JobConfig):
    from prefect_jax.training.live import get_trainer

    trainer = get_trainer(config, run_tags=_run_tags())
    if not trainer.commit_listeners:
        from prefect.events import emit_event

        resource = job_resource(config)

        def announce(step: int) -> None:  # runs in a background thread once the step is committed
            emit_event(
                event=CHECKPOINT_EVENT,
                resource=resource,
                payload={"step": step, "checkpoint_dir": trainer.checkpoints.directory, "max_steps": config.train.max_steps},
            )

        trainer.commit_listeners.append(announce)
    return trainer


def retry_if_transient(task, task_run, state) -> bool:
    """Retry I/O errors, timeouts and preemptions; fail at once on a bad program, a checkpoint
    that does not fit, a NaN loss or a job held by another trainer."""
    from prefect_jax.training.errors import is_transient

    try:
        exc = state.result(raise_on_failure=False)
    except BaseException as err:  # noqa: BLE001 - result() itself may raise the stored exception
        exc = err
    transient = not isinstance(exc, BaseException) or is_transient(exc)
    if not transient:
        get_run_logger().error("not retrying %s: %s", type(exc).__name__, exc)
    return transient


def _train_run_name() -> str:
    params = task_run.parameters
    config, start = params["config"], params["from_step"]
    if isinstance(config, dict):
        config = JobConfig.model_validate(config)
    every, max_steps = config.checkpoint.every_steps, config.train.max_steps
    end = min(max_steps, (start // every + 1) * every) if every else max_steps
    return f"train {start}→{end}"


@task(
    name="restore_or_init",
    task_run_name="restore or init {config.job}",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=2,
    retry_condition_fn=retry_if_transient,
)
def restore_or_init(
    config: JobConfig,
    checkpoint_path: str | None = None,
    wait_for_checkpoint: bool = False,
    max_wait_secs: float = 7200,
    recovery_wait_secs: float = 30,
) -> dict[str, Any]:
    """Resume the job from its latest committed checkpoint, or from `checkpoint_path`, or init.

    Mirrors `SessionManager.prepare_session`: a job that has checkpoints resumes from its
    newest committed one; a new job starts from `checkpoint_path` (warm start) when given,
    else from `init`. With `wait_for_checkpoint`, waits up to `max_wait_secs` for a first
    checkpoint, logging every `recovery_wait_secs`.

    The job's MLflow run is found or created on a background thread while the checkpoint is
    restored and the first step compiles; the task returns once it is known.

    Returns:
        ``{"step": int, "mlflow_run_id": str | None, "checkpoint_dir": str}``
    """
    logger = get_run_logger()
    trainer = _trainer(config)
    step = trainer.restore_or_init(
        checkpoint_path=checkpoint_path,
        wait_for_checkpoint=wait_for_checkpoint,
        max_wait_secs=max_wait_secs,
        recovery_wait_secs=recovery_wait_secs,
    )
    # MLflow opened in the background during the restore; training starts once the run is known,
    # so that its first interval does not share the CPU with MLflow's start.
    run_id = trainer.tracker.run_id
    logger.info("job %s at step %d (%s); MLflow run %s", config.job, step, "restored" if step else "initialised", run_id)
    return {"step": step, "mlflow_run_id": run_id, "checkpoint_dir": trainer.checkpoints.directory}


@task(
    name="train_until_checkpoint",
    task_run_name=_train_run_name,
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=2,
    retry_condition_fn=retry_if_transient,
)
def train_until_checkpoint(config: JobConfig, from_step: int) -> int:
    """Train from `from_step` to the next checkpoint boundary and save (asynchronously).

    If this process does not hold the live state at `from_step` (a retry after a failure,
    another worker), the newest committed checkpoint is restored first. Transient failures
    (I/O, preemption) are retried from there; permanent ones (a bad program, a shape
    mismatch, a NaN/Inf loss, a job leased by another trainer) fail at once.

    Returns:
        The step reached (and checkpointed).
    """
    logger = get_run_logger()
    trainer = _trainer(config)
    stop = trainer.stop_requested()
    if stop is not None:
        logger.warning("not training: the job was asked to stop (%s)", stop.get("reason"))
        return from_step
    if trainer.state is None or trainer.step != from_step:
        restored = trainer.restore_or_init()
        logger.info("live state not at step %d here: restored step %d from storage", from_step, restored)
    logger.info("training from step %d to %d", trainer.step, trainer.next_boundary())
    step = trainer.train_until_checkpoint()
    metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(trainer.last_train_metrics.items()))
    logger.info("step %d checkpointed (%s)", step, metrics)
    return step


@task(name="evaluate_if_new", task_run_name="evaluate {step}", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def evaluate_if_new(config: JobConfig, step: int | None = None, force: bool = False):
    """Evaluate `step` unless it was evaluated before (durable record); publish a table artifact.

    Returns:
        An `EvalResult` (EVALUATED, NO_NEW_CHECKPOINT, MISSING_CHECKPOINT or THROTTLED).
    """
    from prefect_jax.training.evaluation import EvalStatus, as_row

    logger = get_run_logger()
    trainer = _trainer(config)
    result = trainer.evaluate_if_new(step, force=force)
    if result.status is EvalStatus.EVALUATED:
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items()))
        logger.info("%s at step %d: %s", config.eval.name, result.step, metrics)
        publisher.submit(
            create_table_artifact,
            key=artifact_key(config.job, config.eval.name, "results"),
            table=[as_row(r) for r in trainer.records.all()],
            description=f"{config.eval.name} results of job {config.job} by global step",
        )
        emit(EVAL_EVENT, config, {"step": result.step, "eval_name": result.name, "metrics": result.metrics,
                                  "is_final": result.is_final, "stop_reason": result.stop_reason})
    else:
        logger.info("%s of step %s: %s", config.eval.name, step, result.status.value)
    return result


@task(name="export", task_run_name="export {result.step}", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def export(config: JobConfig, result) -> dict[str, str]:
    """Run the eval spec's exporters on an evaluated result; returns ``{exporter: export dir}``."""
    logger = get_run_logger()
    written = _trainer(config).export(result)
    for name, path in written.items():
        logger.info("exporter %s: %s", name, path)
    if written:
        emit(EXPORT_EVENT, config, {"step": result.step, "exports": written})
    return written


__all__ = ["evaluate_if_new", "export", "publisher", "restore_or_init", "train_until_checkpoint"]
