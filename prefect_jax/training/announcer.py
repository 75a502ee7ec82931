"""Telling a job's commit listeners, in order and off the training thread, that a step counts.

The listeners are the Prefect side's (a flow run's events and its evaluation); the `Job` submits
each step it saves, and its `Announcer` tells them once the step is committed.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger("prefect_jax.trainer")


class Announcer:
    """One thread that runs `announce(step)` for each step submitted, in order, each in the
    submitter's context (a listener sees its settings, such as a Prefect API set for one block of
    code, as the command's embedded server is, and its run). A thread started per save cost the
    training thread a thread start in every interval (and the GIL handed over).
    In order: a slow listener delays the next steps' announcements (the listener only queues a
    Prefect event), and a step that retention removed before its turn is not announced."""

    IDLE_SECS = 10.0  # the thread ends after this long without a step (the next save starts one)

    def __init__(self, announce: Callable[[int], None]):
        self._announce = announce
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._unfinished = 0
        self._thread: threading.Thread | None = None

    def submit(self, step: int) -> None:
        with self._idle:
            self._unfinished += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="prefect-jax-commit", daemon=True
                )
                self._thread.start()
        self._queue.put((contextvars.copy_context(), step))

    def wait(self, timeout: float) -> bool:
        """Until every step submitted so far was announced (or `timeout` passed: False)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._unfinished, timeout)

    def _run(self) -> None:
        while True:
            try:
                context, step = self._queue.get(timeout=self.IDLE_SECS)
            except queue.Empty:
                with self._idle:
                    # (a step being submitted counts already: then it waits for it)
                    if not self._unfinished:
                        self._thread = None
                        return
                continue
            try:
                context.run(self._announce, step)
            except Exception:  # noqa: BLE001 - the next steps are still announced
                logger.exception("telling the commit listeners of step %d failed", step)
            finally:
                with self._idle:
                    self._unfinished -= 1
                    self._idle.notify_all()
