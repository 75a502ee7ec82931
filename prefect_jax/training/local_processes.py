"""Processes on this host: whether one still runs (a lease's holder, a flow run's trainer, an
MLflow store's writer), so that a dead one's claim is dropped at once instead of timing out."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one we may not signal counts as alive; a
    zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # (another user's: /proc may hide its state)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (not Linux), or it ended just now
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")
