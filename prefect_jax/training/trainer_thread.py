"""One thread per process for the live trainers' calls made from a flow run's tasks.

Prefect's flow engine answers SIGTERM with its own handler on the main thread, which raises
`TerminationSignal` wherever the main thread is; Prefect needs that handler to be the installed
one to acknowledge a runner's cancel or reschedule (docs/upstream.md 4). A trainer must not be
interrupted halfway through a step or a save, so its work runs here, on a thread of its own,
while the caller waits (`prefect_jax.tasks.notices.call`): the exception lands in that wait,
where the caller tells the trainer's guard (`PreemptionGuard.notice`) and lets the trainer
checkpoint the step in flight. Every call runs in a copy of the caller's context (Prefect's run
context: its logger, its events), one at a time, in the order made.

The thread is a daemon: a process whose flow run ended on a notice exits without waiting for a
call that its notice cut short. This module never imports prefect.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

THREAD_NAME = "prefect-jax-trainer"
# The longest a wait here blocks at a time. The kernel may hand a process's signal to any thread
# that does not block it; a wait blocked on a lock is not interrupted then, and Python runs the
# signal's handler (Prefect's SIGTERM bridge) on the main thread only once that thread runs
# again: after the whole call it waits for (a training interval) without slices.
WAIT_SLICE_SECS = 0.05


class Call:
    """One call for the trainer thread (`submit`)."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, cuttable: bool):
        self.context = contextvars.copy_context()
        self.fn, self.args, self.kwargs = fn, args, kwargs
        # A notice may have the trainer's ending run beside it once it gave it time to end
        # (`prefect_jax.tasks.notices`): it neither trains nor saves (an export, a restore).
        self.cuttable = cuttable
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self._claim = threading.Lock()

    def claim(self) -> bool:
        """Whether whoever asks first runs this call (the trainer thread, or its caller that gave
        up waiting for it: `prefect_jax.tasks.notices.within`)."""
        return self._claim.acquire(blocking=False)

    def run(self) -> None:
        try:
            self.result = self.context.run(self.fn, *self.args, **self.kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
            self.error = exc
        finally:
            self.done.set()


_calls: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None
_lock = threading.Lock()
_outstanding = threading.Condition()  # (its count: calls submitted and not ended)
_count = 0
_running: Call | None = None  # the call the thread runs now


def _serve() -> None:
    global _count, _running
    while True:
        call = _calls.get()
        try:
            if call.claim():
                _running = call
                call.run()
        finally:
            _running = None
            with _outstanding:
                _count -= 1
                _outstanding.notify_all()


def on_trainer_thread() -> bool:
    """Whether this is the trainer thread."""
    return threading.current_thread() is _thread


def _start() -> None:
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name=THREAD_NAME, daemon=True)
            _thread.start()


def submit(fn: Callable, *args, cuttable: bool = False, **kwargs) -> Call:
    """Queue `fn(*args, **kwargs)` for the trainer thread; `wait` for it."""
    global _count
    _start()
    call = Call(fn, args, kwargs, cuttable)
    with _outstanding:
        _count += 1
    _calls.put(call)
    return call


def running() -> Call | None:
    """The call the trainer thread runs now, if any."""
    return _running


def wait(call: Call, timeout: float | None = None) -> bool:
    """Wait for `call` to end (True), or `timeout` seconds (False). A signal's handler that
    raises (Prefect's SIGTERM bridge) raises here, in the waiting thread; the call goes on."""
    return wait_in_slices(call.done.wait, timeout)


def outcome(call: Call):
    """The value `call` returned, or raise what it raised."""
    if call.error is not None:
        raise call.error
    return call.result


def idle(timeout: float | None = None) -> bool:
    """Wait up to `timeout` seconds until every call submitted has ended; True if they have."""

    def ended(seconds: float) -> bool:
        with _outstanding:
            return _outstanding.wait_for(lambda: _count == 0, seconds)

    return wait_in_slices(ended, timeout)


def wait_in_slices(wait_for: Callable[[float], bool], timeout: float | None) -> bool:
    """`wait_for(seconds)` in slices of `WAIT_SLICE_SECS` until it is True, for `timeout` seconds
    at most (None: for ever). The flow run's main thread waits for its trainer, for MLflow and
    Prefect (a first run's link) and for an export's evaluated step through here, so that a
    signal's handler runs in the wait (see `WAIT_SLICE_SECS`)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = WAIT_SLICE_SECS if deadline is None else deadline - time.monotonic()
        if wait_for(max(0.0, min(WAIT_SLICE_SECS, left))):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
