"""Who hears how far training got: listeners called as the loop advances (the command's progress
bar, a train task's progress lines, a test's pacing), each failure of theirs logged, never raised
into training. (Prefect's progress artifact is not one: the flow updates it once per interval,
from `Trainer.last_train_metrics`, in `flows/task_loop.py`.)

A listener is heard for every trainer of the process (`add_progress_listener`), or only for the
training called from one context (`progress_heard_here`: a train task's progress lines). The
trainer thread runs each call in a copy of its caller's context (`trainer_thread`), so two jobs'
tasks waiting on one process's trainer thread each hear their own job, not the other's.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator

logger = logging.getLogger("prefect_jax.trainer")

ProgressListener = Callable[[int, int, dict[str, float]], None]
_progress_listeners: list[ProgressListener] = []
_heard_here: contextvars.ContextVar[tuple[ProgressListener, ...]] = contextvars.ContextVar(
    "prefect_jax_progress_heard_here", default=()
)


def add_progress_listener(fn: ProgressListener) -> Callable[[], None]:
    """Call ``fn(step, max_steps, last_metrics)`` as training advances; returns a remover."""
    _progress_listeners.append(fn)
    return lambda: _progress_listeners.remove(fn) if fn in _progress_listeners else None


@contextlib.contextmanager
def progress_heard_here(fn: ProgressListener) -> Iterator[None]:
    """Within the block, call ``fn(step, max_steps, last_metrics)`` as training called from this
    context advances (on this thread, or on the trainer thread, which runs a call in a copy of
    its caller's context), not as another context's training does."""
    token = _heard_here.set((*_heard_here.get(), fn))
    try:
        yield
    finally:
        _heard_here.reset(token)


def listening() -> bool:
    """Whether anyone listens (the loop reads a log point's metrics to the host only then)."""
    return bool(_progress_listeners or _heard_here.get())


def notify_progress(step: int, max_steps: int, metrics: dict[str, float]) -> None:
    for fn in [*_progress_listeners, *_heard_here.get()]:
        try:
            fn(step, max_steps, metrics)
        except Exception:  # noqa: BLE001 - a broken progress bar must not stop training
            logger.exception("progress listener failed")
