"""Processes on this host: whether one still runs (a lease's holder, a flow run's trainer, an
MLflow store's writer), so that a dead one's claim is dropped at once instead of timing out; and
whether a lease's holder is gone, by its heartbeat or its process here (`holder_gone`)."""

from __future__ import annotations

import os
import socket
import time


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


def holder_gone(current: dict, timeout_secs: float) -> str | None:
    """Why the holder of `current` (a lease as read) writes no more, or None: its heartbeat is
    older than its timeout (`timeout_secs` where it names none), or its process on this host
    is gone."""
    age = time.time() - float(current.get("heartbeat", 0))
    if age > float(current.get("timeout_secs", timeout_secs)):
        if current.get("torn"):
            return f"its lease file is torn and was last written {age:.0f}s ago"
        return f"heartbeat {age:.0f}s old"
    pid, here = current.get("pid"), current.get("host") == socket.gethostname()
    if here and pid is not None and int(pid) != os.getpid() and not process_alive(int(pid)):
        return f"process {pid} on this host is gone"
    return None
