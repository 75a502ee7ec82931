"""One writer per job: ``<job>/lease.json`` names the trainer that holds the job.

The holder refreshes a heartbeat from a background thread. Another trainer fails fast
naming the owner, unless the lease is stale: its heartbeat is older than the timeout, or
its holder was a process on this host that no longer exists (a SIGKILLed run, rerun on the
same machine, need not wait out the timeout). A lease with the same owner id (the same
Prefect flow run, retried) is taken over at once. The lease is released when training ends,
however it ends; after a SIGKILL it goes stale.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from prefect_jax.training.errors import LeaseHeldError
from prefect_jax.training.storage import JobStorage

logger = logging.getLogger("prefect_jax.lease")


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """The lease of one job.

    Args:
        storage: the job's storage.
        owner_id: who we are across processes (the Prefect flow-run id when there is one).
        timeout_secs: a heartbeat older than this is stale.
    """

    def __init__(self, storage: JobStorage, owner_id: str | None = None, timeout_secs: float = 120.0):
        self.storage = storage
        self.path = storage.path("lease.json")
        self.owner_id = owner_id
        self.timeout_secs = timeout_secs
        self.token: str | None = None
        # The record of the holder this process took the lease over from (its flow run, host,
        # pid, and ``reason``: why it was stale), or None: who to mark as crashed in the UIs.
        self.taken_over: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict:
        return {
            "token": self.token,
            "flow_run_id": self.owner_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "heartbeat": time.time(),
            "timeout_secs": self.timeout_secs,
        }

    def read(self) -> dict | None:
        try:
            return self.storage.read_json(self.path)
        except ValueError:  # a torn lease file is as good as none
            return None

    def _stale_reason(self, current: dict) -> str | None:
        age = time.time() - float(current.get("heartbeat", 0))
        if age > float(current.get("timeout_secs", self.timeout_secs)):
            return f"heartbeat {age:.0f}s old"
        if current.get("host") == socket.gethostname() and current.get("pid") is not None:
            pid = int(current["pid"])
            if pid != os.getpid() and not process_alive(pid):
                return f"process {pid} on this host is gone"
            if pid == os.getpid() and current.get("token") != self.token:
                return "left by this process"
        if self.owner_id and current.get("flow_run_id") == self.owner_id:
            return "same flow run (a retry)"
        return None

    @property
    def held(self) -> bool:
        return self.token is not None

    def acquire(self) -> None:
        """Take the lease, or raise LeaseHeldError naming the live owner."""
        if self.held:
            return
        current = self.read()
        if current is not None:
            reason = self._stale_reason(current)
            if reason is None:
                raise LeaseHeldError(self.storage.job_dir, current, time.time() - float(current.get("heartbeat", 0)), self.timeout_secs)
            logger.warning("taking over the lease of %s (%s): %s", self.storage.job_dir, reason, current)
            self.taken_over = dict(current, reason=reason)
        self.token = uuid.uuid4().hex
        self.storage.write_json(self.path, self._record())
        confirmed = self.read()
        if not confirmed or confirmed.get("token") != self.token:  # another trainer won the race
            self.token = None
            raise LeaseHeldError(self.storage.job_dir, confirmed or {}, 0.0, self.timeout_secs)
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="prefect-jax-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        interval = max(0.5, self.timeout_secs / 4)
        while not self._stop.wait(interval):
            try:
                current = self.read()
                if not current or current.get("token") != self.token:
                    logger.error("lost the lease of %s to %s", self.storage.job_dir, current)
                    return
                self.storage.write_json(self.path, self._record())
            except Exception:  # noqa: BLE001 - a missed beat is retried on the next one
                logger.exception("lease heartbeat failed")

    def release(self) -> None:
        """Give the lease back (only if we still hold it)."""
        if not self.held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            current = self.read()
            if current and current.get("token") == self.token:
                self.storage.fs.rm(self.path)
        finally:
            self.token = None
