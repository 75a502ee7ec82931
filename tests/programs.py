"""Test programs: the tiny digits program with injected failures."""

from __future__ import annotations

import threading

from prefect_jax.examples.digits import DigitsProgram


class FailingDigits(DigitsProgram):
    """Tiny digits whose input pipeline raises `error` when batch number `fail_at` is produced.

    Batch i is consumed by step i + 1. `failures` is how many times it raises before it
    behaves (None: every time).
    """

    def __init__(self, fail_at: int, error: type[BaseException] = OSError, failures: int | None = 1):
        super().__init__(hidden=(32, 32), learning_rate=3e-3, batch_size=32, dropout=0.1)
        self.fail_at, self.error, self.failures_left = fail_at, error, failures
        self._lock = threading.Lock()

    def train_data(self, seed: int):
        def check(index, batch):
            if index == self.fail_at:
                with self._lock:
                    if self.failures_left is None or self.failures_left > 0:
                        if self.failures_left is not None:
                            self.failures_left -= 1
                        raise self.error(f"injected failure producing batch {index}")
            return batch

        return super().train_data(seed).map_with_index(check)


def transient():
    """Fails once in the interval 20→40 with an OSError, then behaves."""
    return FailingDigits(fail_at=25)


def permanent():
    """Fails before the first checkpoint, every time."""
    return FailingDigits(fail_at=5, error=RuntimeError, failures=None)
