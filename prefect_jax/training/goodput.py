"""Goodput: how much of a job's wall time went into the steps it kept, and where the rest went.

Every process that trains a job (an *attempt*: the first run, each rerun after a preemption)
keeps an account of its own time by phase and writes it to ``<job>/goodput.json`` when it
starts, at each checkpoint and when it ends. The file is small and rewritten whole (no fsync:
it has to survive the process, not the machine). The next attempt learns from the step it
restores which of the previous attempt's steps were kept; steps trained past it were lost and
count as *recomputed*.

Phases of an attempt, what the account makes of them and the summary (`summarize`,
`describe`, `mlflow_metrics`) are `prefect_jax.training.goodput_summary`'s.

A process that waited for another process of its own flow run to end (Prefect started the run
twice; see `prefect_jax.training.lease`) starts its attempt's clock when the wait ended, and its
entry says ``waited_for_another_process``: what it did before overlapped the other's training.

This module never imports prefect.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

from prefect_jax.training.goodput_summary import (
    counted_attempts,
    running_account,
    summarize,
)
from prefect_jax.training.names import GOODPUT_FILE
from prefect_jax.training.records import DamagedRecordError, read_record, set_aside

logger = logging.getLogger("prefect_jax.trainer")

# Past it, no-op reruns are dropped and the oldest attempts folded (`_bounded`).
MAX_ATTEMPTS_KEPT = 500
_TAIL = 32  # per attempt, the cumulative train time at its newest saves (backups make many)
_process_clock_taken = False  # the first ledger of a process counts from the process start


def process_start_time() -> float:
    """When this process started (epoch seconds, to the clock tick).

    On Linux from ``/proc/self/stat`` against the boot-time clock: psutil's create time adds the
    boot time, which the kernel gives in whole seconds (up to a second off). Elsewhere psutil's,
    else now."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return float(psutil.Process(os.getpid()).create_time())
    except Exception:  # noqa: BLE001 - no psutil: count from the first call
        return time.time()


class GoodputLedger:
    """This process's attempt at a job, written into the job's goodput ledger.

    Args:
        storage: the job's `JobStorage`.
        enabled: False in a process that does not write the job's records.
    """

    def __init__(self, storage, enabled: bool = True):
        global _process_clock_taken
        self.storage, self.enabled = storage, enabled
        self.path = storage.path(GOODPUT_FILE)
        # A later trainer in the same process (a notebook, a test) starts its clock when it is made.
        self.started_at = time.time() if _process_clock_taken else process_start_time()
        _process_clock_taken = True
        self.attempt: dict[str, Any] | None = None
        self._restore_began: float | None = None
        # The attempts before this one, as read at its first write.
        self._earlier: list[dict[str, Any]] | None = None
        # This process waited for another process of its flow run first (`restart_clock`).
        self._waited = False

    # -- the attempt's clock ------------------------------------------------------------------

    def restore_began(self) -> None:
        if self.attempt is None:
            self._restore_began = time.time()

    def restart_clock(self, at: float) -> None:
        """This process waited for another process of its flow run to end before it took the job
        (see `Lease.wait_for_duplicate`): its attempt starts at `at`, when the wait ended; what it
        did before overlapped the other's training."""
        if self.attempt is None:  # (a trainer made after the wait started its clock later)
            self.started_at = max(self.started_at, at)
            self._restore_began = max(self._restore_began or at, at)
            self._waited = True

    def begin(self, step: int) -> None:
        """The live state is at `step` (restored, or made by init): open this process's attempt."""
        if self.attempt is not None:
            # Restored again within one process (a retried task): the same attempt.
            self.attempt["restored_again"] = self.attempt.get("restored_again", 0) + 1
            return
        now = time.time()
        began = self._restore_began or now
        self.attempt = {
            "id": uuid.uuid4().hex[:12],
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_start": self.started_at,
            "from_step": int(step),
            "step": int(step),
            "updated": now,
            "ended": None,
            "seconds": {"startup": max(0.0, began - self.started_at), "restore": now - began},
            "tail": [[int(step), 0.0]],
            **({"waited_for_another_process": True} if self._waited else {}),
        }
        self._write()

    def add(self, phase: str, seconds: float) -> None:
        if self.attempt is not None and seconds:
            s = self.attempt["seconds"]
            s[phase] = s.get(phase, 0.0) + seconds

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def trained_to(self, step: int) -> None:
        """A checkpoint of `step` was started: remember the train time it took to get there, and
        write."""
        if self.attempt is None:
            return
        a = self.attempt
        a["step"] = int(step)
        a["tail"] = (a["tail"] + [[int(step), a["seconds"].get("train", 0.0)]])[-_TAIL:]
        self._write()

    def saved(self, seconds: float) -> None:
        """A save is out of the training thread's way after `seconds` (it blocked training that
        long: the lease check, this ledger, Orbax's blocking part and its wait for the save
        before)."""
        if self.attempt is not None:
            a = self.attempt
            a["saves"] = a.get("saves", 0) + 1
            a["save_s"] = round(a.get("save_s", 0.0) + seconds, 4)
            if a["saves"] == 1:
                # On record now, for a rerun if this attempt is killed before its next save.
                self._write()

    @property
    def earlier(self) -> list[dict[str, Any]] | None:
        """The attempts before this one, as read at this attempt's first write (None before it)."""
        return self._earlier

    def end(self, how: str) -> None:
        """The attempt ends `how`: one of goodput_summary's ends (`FINISHED`, `PREEMPTED`,
        `FAILED`, `CLOSED`, `LOST_PROCESS`)."""
        if self.attempt is not None and self.attempt["ended"] is None:
            self.attempt["ended"] = how
            self._write()

    # -- the ledger ---------------------------------------------------------------------------

    def _write(self) -> None:
        if not self.enabled or self.attempt is None:
            return
        a = self.attempt
        a["updated"] = time.time()
        a["seconds"] = {k: round(v, 4) for k, v in a["seconds"].items()}
        a["tail"] = [[s, round(t, 4)] for s, t in a["tail"]]
        try:
            if self._earlier is None:
                # Read once: while this process holds the job's lease nobody else writes it. An
                # unreadable ledger is not written over (the write is tried again at the next
                # save); a damaged one is moved aside, kept, and a new one started.
                try:
                    ledger = read_record(self.storage, self.path) or {}
                except DamagedRecordError as exc:
                    moved = set_aside(self.storage, exc.path)
                    logger.warning(
                        "%s: moved aside to %s, kept there; the ledger starts again with this "
                        "attempt (the goodput of the attempts before it is in that copy)",
                        exc,
                        moved,
                    )
                    ledger = {}
                self._earlier = [e for e in ledger.get("attempts", []) if e.get("id") != a["id"]]
            self.storage.write_json(self.path, self._ledger(), durable=False)
        except Exception:  # noqa: BLE001 - an account must never stop training
            logger.warning("could not write the goodput ledger %s", self.path, exc_info=True)

    def _ledger(self) -> dict[str, Any]:
        """The ledger as this attempt last wrote it: the earlier attempts (the oldest folded) and
        this one."""
        return {"attempts": _bounded(self._earlier + [self.attempt])}

    def read(self) -> dict[str, Any]:
        return read_ledger(self.storage)

    def summary(self) -> dict[str, Any]:
        """The job's goodput: from memory once this attempt has written its entry, else from
        storage."""
        if self.attempt is not None and self._earlier is not None:
            return summarize(self._ledger())
        return summarize(self.read())


def read_ledger(storage) -> dict[str, Any]:
    """The job's ledger for a summary (empty if unreadable: `damaged_records` names a damaged
    one; the ledger's writer moves it aside before it writes)."""
    try:
        return storage.read_json(storage.path(GOODPUT_FILE)) or {}
    except Exception:  # noqa: BLE001 - unreadable: as if empty, for the summary only
        return {}


def _bounded(attempts: list[dict], limit: int = MAX_ATTEMPTS_KEPT) -> list[dict]:
    """At most `limit` entries with the same summary: past it, the reruns of a finished job that
    trained nothing are dropped, then the oldest attempts folded into one."""
    if len(attempts) > limit:
        attempts = counted_attempts(attempts)
    if len(attempts) > limit:
        cut = len(attempts) - limit + 1
        attempts = [_fold(attempts, cut)] + attempts[cut:]
    return attempts


def _fold(attempts: list[dict], cut: int) -> dict:
    """``attempts[:cut]`` as one entry that carries their account (each judged against the
    attempt after it, which ``attempts[cut]`` is for the last), so the file stays small and the
    summary stays what it was. It keeps what the next attempt is judged against: the last folded
    attempt's step, end and last record."""
    last = attempts[cut - 1]
    return {
        "folded": True,
        "carried": running_account(attempts[: cut + 1], cut),
        "process_start": attempts[0]["process_start"],
        "from_step": attempts[0]["from_step"],
        "step": last["step"],
        "ended": last.get("ended"),
        "updated": last["updated"],
        "tail": last.get("tail", []),
        "seconds": {},
    }
