"""Who hears how far training got: listeners called as the loop advances (the command's progress
bar, Prefect's progress artifact, a test's pacing), each failure of theirs logged, never raised
into training."""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger("prefect_jax.trainer")

ProgressListener = Callable[[int, int, dict[str, float]], None]
_progress_listeners: list[ProgressListener] = []


def add_progress_listener(fn: ProgressListener) -> Callable[[], None]:
    """Call ``fn(step, max_steps, last_metrics)`` as training advances; returns a remover."""
    _progress_listeners.append(fn)
    return lambda: _progress_listeners.remove(fn) if fn in _progress_listeners else None


def listening() -> bool:
    """Whether anyone listens (the loop reads a log point's metrics to the host only then)."""
    return bool(_progress_listeners)


def notify_progress(step: int, max_steps: int, metrics: dict[str, float]) -> None:
    for fn in list(_progress_listeners):
        try:
            fn(step, max_steps, metrics)
        except Exception:  # noqa: BLE001 - a broken progress bar must not stop training
            logger.exception("progress listener failed")
