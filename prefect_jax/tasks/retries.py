"""When a failed task run is retried (the conditions), and how often by default (the tasks' own
`RetrySpec`); a flow's `RetrySpec` is applied over them with `with_options` in
`prefect_jax/flows/retry_options.py`."""

from __future__ import annotations

from prefect import get_run_logger

from prefect_jax.training.specs import RetrySpec


def retry_if_transient(task, task_run, state) -> bool:
    """Retry I/O errors, timeouts and preemptions; fail at once on a bad program, a checkpoint
    that does not fit, a NaN loss, a job held by another trainer or memory run out. With several
    JAX processes, never: a task retried in one process alone would wait forever for the others
    (the group's rerun resumes them all from the newest committed step)."""
    from prefect_jax.training import cluster
    from prefect_jax.training.errors import OUT_OF_MEMORY_FIX, is_transient, out_of_memory

    if cluster.several():
        get_run_logger().error(
            "not retrying: this job trains in %d JAX processes, which are rerun together",
            cluster.process_count(),
        )
        return False

    exc = _failure(state)
    transient = exc is None or is_transient(exc)
    if not transient:
        get_run_logger().error("not retrying %s: %s", type(exc).__name__, exc)
        if out_of_memory(exc):
            get_run_logger().error("%s", OUT_OF_MEMORY_FIX)
    return transient


def retry_unless_lost(task, task_run, state) -> bool:
    """Retry (evaluations and exports: process 0's own work), unless an eval hook raised (its
    step is recorded: a retry would never call it on that step again), an export failed for a
    reason of the program's (`ExportFailedError`: a retry fails the same way) or another JAX
    process of the job went away (the job's processes are rerun together, from the newest
    committed step)."""
    from prefect_jax.training import cluster
    from prefect_jax.training.errors import NEVER_RETRIED

    exc = _failure(state)
    if isinstance(exc, NEVER_RETRIED):
        get_run_logger().error("not retrying: %s", exc)
        return False
    if not cluster.several():
        return True
    if exc is not None and cluster.lost_a_process(exc):
        get_run_logger().error("not retrying: %s", exc)
        return False
    return True


def _failure(state) -> BaseException | None:
    """The exception a failed task run's `state` holds, if any."""
    try:
        exc = state.result(raise_on_failure=False)
    except BaseException as err:  # noqa: BLE001 - result() itself may raise the stored exception
        exc = err
    return exc if isinstance(exc, BaseException) else None


DEFAULT_RETRIES = RetrySpec()
"""The tasks' own retries (their decorators'); a flow applies its `RetrySpec` over them."""
