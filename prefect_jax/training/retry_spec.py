"""RetrySpec: how often a failed task run is retried, by kind of task (a flow's `retry_spec`)."""

from __future__ import annotations

from pydantic import Field, field_validator

from prefect_jax.training.spec_base import Spec


class RetrySpec(Spec):
    """How often a failed task run is retried, by kind of task (Prefect's `retries` and
    `retry_delay_seconds`). A failure a retry cannot fix is not retried: the program's, the
    config's or the data's (a ValueError, TypeError, KeyError..., a NaN loss), out of memory, a
    lease another trainer holds (`prefect_jax.training.errors.is_transient`); any other is, I/O
    and timeouts, and XLA's runtime errors (a device's or a collective's failure, often gone on
    a retry). A job trained by several JAX processes retries no training task (its processes
    are rerun together).

    Args:
        retries: retries of the training tasks (``restore_or_init``, ``train_until_checkpoint``).
        eval_retries: retries of ``evaluate_if_new``, ``export`` and ``recover``.
        retry_delay_seconds: seconds between a failure and its retry.
    """

    retries: int = Field(2, description="Retries of restore_or_init and train_until_checkpoint.")
    eval_retries: int = Field(1, description="Retries of evaluate_if_new, export and recover.")
    retry_delay_seconds: float = Field(2.0, description="Seconds between a failure and its retry.")

    @field_validator("retries", "eval_retries", "retry_delay_seconds")
    @classmethod
    def _not_negative(cls, v, info):
        if v < 0:
            raise ValueError(f"{info.field_name}={v!r} must be 0 or more; 0 turns retries off")
        return v
