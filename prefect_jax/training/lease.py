"""One writer per job: ``<job>/lease.json`` names the trainer that holds the job.

The holder refreshes a heartbeat from a background thread. Another trainer fails fast
naming the owner, unless the lease is stale: its heartbeat is older than the timeout, or
its holder was a process on this host that no longer exists (a SIGKILLed run, rerun on the
same machine, need not wait out the timeout). A lease with the same owner id (the same
Prefect flow run, retried) is taken over at once, unless its holder is a live process on this
host: then Prefect started that flow run twice (its process worker reports one crash twice, and
the rerun automation reacts to each), and the second process waits for the first to end before
it takes over, so that one process trains the job. A flow run of one JAX process takes the lease
before it starts JAX (`take_early`; its trainer adopts it), so that a second start of it waits
before its own JAX start too. The lease is released when training ends, however it ends; after a
SIGKILL it goes stale. A save still written after a SIGTERM's grace period keeps it, marked
``finishing``, until the save ends (`lease_finishing`).

A holder checks that it still holds the lease before each checkpoint (`verify`): one whose lease
was taken over (its heartbeat went stale, or a rerun of its flow run started on another machine)
stops there with `LeaseLostError` instead of writing over the new holder's steps. On local paths,
S3 and GCS each write of the lease lands only over the record its writer read (`lease_file`), so
a lost holder's late heartbeat never lands over its taker's record.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from prefect_jax.training import lease_takeover as takeover
from prefect_jax.training.errors import JobDirectoryGoneError, LeaseHeldError, LeaseLostError
from prefect_jax.training.lease_file import LeaseFile
from prefect_jax.training.lease_finishing import wait_while_finishing
from prefect_jax.training.local_processes import holder_gone
from prefect_jax.training.names import LEASE_FILE
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.storage import JobStorage

logger = logging.getLogger("prefect_jax.lease")


def _identity(storage: JobStorage) -> tuple | None:
    """Which directory the job's is on a local disk (device and inode; ``("gone",)``: none is
    there); None on other storage (no such identity: only a directory gone is seen there)."""
    if storage.protocol != "file":
        return None
    try:
        st = os.stat(storage.job_dir)
    except FileNotFoundError:
        return ("gone",)
    return (st.st_dev, st.st_ino)


# Why a lease is taken over from a retry of its own flow run.
_SAME_RUN = "same flow run (a retry)"
# How often a second process of one flow run looks whether the first has ended.
DUPLICATE_POLL_SECS = 1.0
# Job dir: when this process stopped waiting for another process of its flow run.
_duplicate_wait_ended: dict[str, float] = {}


def duplicate_wait_ended(job_dir: str) -> float | None:
    """When this process stopped waiting for another process of its own flow run to end its
    training of the job at `job_dir` (`Lease.wait_for_duplicate`), or None; told once: this
    process's attempt at the job starts then."""
    return _duplicate_wait_ended.pop(job_dir, None)


class Lease:
    """The lease of one job.

    Args:
        storage: the job's storage.
        owner_id: who we are across processes (the Prefect flow-run id when there is one).
        timeout_secs: a heartbeat older than this is stale.
    """

    def __init__(self, storage: JobStorage, owner_id: str | None = None, timeout_secs=120.0):
        self.storage = storage
        self.path = storage.path(LEASE_FILE)
        self.file = LeaseFile(storage, self.path)  # (written over what was read: see there)
        self.owner_id = owner_id
        self.timeout_secs = timeout_secs
        self.token: str | None = None
        # what a preempted holder may still write (`lease_finishing.release_after`)
        self.finishing: str | None = None
        # The record of the holder this process took the lease over from (its flow run, host,
        # pid, and ``reason``: why it was stale), or None: who to mark as crashed in the UIs.
        self.taken_over: dict | None = None
        # the last `acquire` waited for a holder to let go (whose last save may have committed)
        self.waited_for_holder = False
        # The record of the trainer that took this process's lease over (see `verify`), or None.
        self.lost_to: dict | None = None
        # called once, with the new holder's record, when lost
        self.on_lost: Callable[[dict], None] | None = None
        # when `verify` last read the lease and found it ours (monotonic)
        self._confirmed_at: float | None = None
        self._written_at: float | None = None  # when this process last wrote its lease
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._writing = threading.Lock()  # one write of the record at a time (`finishing` lands)
        # The job's directory as this process found it when it took the lease (`_identity`), and
        # why it is not that one any more (None: it is, or nobody looked).
        self._home: tuple | None = None
        self.vanished: str | None = None

    def _record(self) -> dict:
        return {
            "token": self.token,
            "flow_run_id": self.owner_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "heartbeat": time.time(),
            "timeout_secs": self.timeout_secs,
            **({"finishing": self.finishing} if self.finishing else {}),
        }

    def read(self) -> dict | None:
        """The lease record, or None when there is none; a torn one is held by a trainer nobody
        can name (`LeaseFile._torn`)."""
        return self.file.read()[0]

    def stale_reason(self, current: dict) -> str | None:
        gone = holder_gone(current, self.timeout_secs)
        if gone is not None:
            return gone
        pid, here = current.get("pid"), current.get("host") == socket.gethostname()
        if here and pid is not None and int(pid) == os.getpid():
            if current.get("token") != self.token:
                return "left by this process"
        if self.owner_id and current.get("flow_run_id") == self.owner_id:
            return _SAME_RUN
        return None

    def live_duplicate(self, current: dict) -> int | None:
        """The pid of the holder when it is another live process on this host running the same
        flow run as this one (Prefect started the flow run twice), else None: on this host, a
        holder that `stale_reason` finds stale only as "the same flow run" is alive."""
        pid = current.get("pid")
        elsewhere = (
            current.get("host") != socket.gethostname() or pid is None or int(pid) == os.getpid()
        )
        return None if elsewhere or self.stale_reason(current) != _SAME_RUN else int(pid)

    def wait_for_duplicate(self) -> dict | None:
        """While the holder is another live process of this same flow run on this host, wait for
        it to end (or its heartbeat to go stale); return the lease as it then is. `acquire`
        does this first; a flow does it before it starts JAX (the other process holds the
        accelerator). See `duplicate_wait_ended`."""
        current = self.read()
        pid = self.live_duplicate(current) if current is not None else None
        if pid is None:
            return current
        self.waited_for_holder = True
        logger.warning(
            "flow run %s already trains job %s in process %d on this host: Prefect started this "
            "flow run twice (a crash reported twice makes a rerun automation rerun it twice). "
            "Waiting for process %d to end, so that one process trains the job; this one then "
            "resumes from the newest committed step.",
            self.owner_id,
            redact_url(self.storage.job_dir),
            pid,
            pid,
        )
        started = time.monotonic()
        while current is not None and self.live_duplicate(current) is not None:
            time.sleep(DUPLICATE_POLL_SECS)
            current = self.read()
        logger.warning(
            "process %d ended (or went stale) after %.0fs: job %s is this process's to train",
            pid,
            time.monotonic() - started,
            redact_url(self.storage.job_dir),
        )
        _duplicate_wait_ended[self.storage.job_dir] = time.time()
        return current

    @property
    def held(self) -> bool:
        return self.token is not None

    def is_free(self) -> bool:
        """Whether `acquire` would find no live holder (none, or a stale one), read once: a
        caller's guess before work that needs the job, not a claim (only `acquire` is one)."""
        current = self.read()
        return current is None or self.stale_reason(current) is not None

    def verify(self, max_age: float = 0.0) -> None:
        """Fencing: raise `LeaseLostError` when another trainer took the lease over since this
        process took it (read from storage: called before each checkpoint, a write). The lease
        is then no longer this process's to release. `max_age`: not read again if a read found it
        ours less than that many seconds ago (a loss the heartbeat saw since is still raised)."""
        if self.lost_to is None:
            if not self.held:
                return
            if self._confirmed_at is not None and time.monotonic() - self._confirmed_at < max_age:
                return
            try:
                current = self.read()
            except Exception as exc:  # noqa: BLE001 - storage unreachable for a moment: the heartbeat goes on looking
                logger.warning(
                    "could not read the lease of %s before a checkpoint (%s): going on",
                    redact_url(self.storage.job_dir),
                    type(exc).__name__,
                )
                return
            if current is not None and current.get("torn") and self._beat_is_fresh():
                self.write_beat()  # (ours, torn: written again)
                current = self.read()
            if current is not None and current.get("token") == self.token:
                self._confirmed_at = time.monotonic()
                return
            self._lose(current or {})
        if self.vanished is not None:
            raise JobDirectoryGoneError(redact_url(self.storage.job_dir), self.vanished)
        raise LeaseLostError(redact_url(self.storage.job_dir), self.lost_to or {})

    def _moved_away(self) -> str | None:
        """Why the job's directory is not the one this process took the lease in (its lease file
        being gone), or None: it is, as far as can be told."""
        where = redact_url(self.storage.job_dir)
        try:
            if self._home is None:  # object storage: a job with nothing left under it is gone
                gone = not self.storage.fs.exists(self.storage.job_dir)
                return f"the job's directory {where} is gone" if gone else None
            now = _identity(self.storage)
        except OSError as exc:  # a mount that dropped answers so
            return f"the job's directory {where} cannot be read ({type(exc).__name__}: {exc})"
        if now == ("gone",):
            return f"the job's directory {where} is gone"
        if now != self._home:
            return (
                f"the job's directory {where} disappeared and is another directory now (a storage "
                "unmounted and mounted again, or made again by a write)"
            )
        return None

    def _lose(self, current: dict) -> None:
        first = self.lost_to is None
        if first and not current:
            self.vanished = self._moved_away()
        if first and self.vanished is not None:
            logger.error("%s: this process writes nothing more there", self.vanished)
        elif first:
            logger.error(
                "lost the lease of %s to %s",
                redact_url(self.storage.job_dir),
                current or "nobody (its lease file is gone)",
            )
        self.lost_to = current
        self.token, self.finishing = None, None
        self._stop.set()
        if first and self.on_lost is not None:
            self.on_lost(current)

    def acquire(self, recheck: bool = False) -> None:
        """Take the lease, or raise LeaseHeldError naming the live owner (`LeaseLostError` once
        it was taken over from this process: a process does not take a lost lease back).
        `recheck`: a lease this process holds is read again (a restore after a failure must not
        go on in a directory that vanished meanwhile); each interval's start does not (the save
        reads it anyway, and each read is a round trip to object storage). A restore that lost
        the lease to a live process of its own flow run on this host (two of them took it as it
        was freed, the later write won) waits for it, as for any such process, and takes it anew:
        the restore reads the state again, so nothing held before the loss is written."""
        self.waited_for_holder = False
        if self.lost_to is not None or (recheck and self.held):
            try:
                self.verify()
            except LeaseLostError:
                if not (recheck and self.lost_to and self.live_duplicate(self.lost_to)):
                    raise
                logger.warning(
                    "lost the lease of %s to another process of this flow run: waiting for it",
                    redact_url(self.storage.job_dir),
                )
                self.lost_to = None
        if self.held:
            return
        while True:
            self.taken_over = None  # (what this pass takes over: see `mark_taken_over`)
            current = wait_while_finishing(self, self.wait_for_duplicate())
            if current is not None and self.live_duplicate(current) is not None:
                continue  # (one of this flow run took it as the finishing holder let go)
            if current is not None:
                reason = self.stale_reason(current)
                if reason is None:
                    raise LeaseHeldError(self.storage.job_dir, current, self.timeout_secs)
                logger.warning(
                    "taking over the lease of %s (%s): %s", self.storage.job_dir, reason, current
                )
                self.taken_over = dict(current, reason=reason)
            again, version = self.file.read()
            if again != current and not takeover.same_holder_beat(self, current, again):
                continue  # (written since it was judged: judged again)
            self.token = uuid.uuid4().hex
            for _ in range(takeover.TAKEOVER_WRITES):  # (what a read-back finds: `takeover`)
                if self.file.write_if(self._record(), version, make_parent=True):
                    self._written_at = time.monotonic()
                confirmed, version = self.file.read()
                then = takeover.after_takeover_write(self, current, confirmed)
                if then != takeover.WRITE_AGAIN:
                    break
                if confirmed is None:  # (the holder let go: not taken over)
                    self.taken_over = None
            if confirmed and confirmed.get("token") == self.token:
                self._home = _identity(self.storage)
                break
            self.token = None  # another trainer won the race, or the holder kept the job
            if then == takeover.JUDGE_AGAIN:  # (it waits for the holder's writes)
                continue
            if confirmed is None or self.live_duplicate(confirmed) is None:
                raise LeaseHeldError(self.storage.job_dir, confirmed or {}, self.timeout_secs)
            # A live process of this same flow run on this host (its late beat landed over this
            # write, or it took a lease just freed): waited for as any such, not failed.
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="prefect-jax-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        interval = max(0.5, self.timeout_secs / 4)
        while not self._stop.wait(interval):
            try:
                if not self.write_beat():
                    return
            except Exception:  # noqa: BLE001 - a missed beat is retried on the next one
                logger.exception("lease heartbeat failed")

    def _beat_is_fresh(self) -> bool:
        """Whether this process confirmed or wrote its lease within the lease's timeout: no other
        trainer can have taken it over since (a takeover waits for a stale heartbeat)."""
        last = max(self._confirmed_at or 0.0, self._written_at or 0.0)
        return last > 0 and time.monotonic() - last < self.timeout_secs

    def write_beat(self) -> bool:
        """Write the heartbeat over this process's own record, only over the record read
        (`LeaseFile.write_if`); whether the lease is still this process's. Found another's (or
        none), the lease is lost (the next checkpoint's `verify` stops training), unless it was
        released meanwhile. Found torn while this process's beats kept it fresh, it was this
        process's own (bit rot, a partial write: no other trainer can have taken it) and is
        written again. Written into the job's directory as this process found it, never into one
        made anew: the directory may vanish between the read and the write, and a write that made
        its parent again would hide that (the next read would find this lease in place)."""
        if self._home is not None and _identity(self.storage) != self._home:
            if not self._stop.is_set():
                self._lose({})  # (`_moved_away` says why)
            return False
        with self._writing:  # (a record built before `finishing` was set never lands after it)
            for _ in range(2):  # (refused: read again, and judged on what is there now)
                current, version = self.file.read()
                if current and current.get("torn") and self._beat_is_fresh():
                    logger.warning(
                        "the lease file %s is torn; this trainer holds the lease and writes it "
                        "again",
                        current["torn"],
                    )
                elif not current or current.get("token") != self.token:
                    if not self._stop.is_set():  # (set: released meanwhile, not ours to write)
                        self._lose(current or {})
                    return False
                if self._stop.is_set():  # (released meanwhile)
                    return False
                try:
                    written = self.file.write_if(self._record(), version)
                except FileNotFoundError:  # gone between the look above and the write
                    if not self._stop.is_set():
                        self._lose({})
                    return False
                if written:
                    self._written_at = time.monotonic()
                    return True
            return True  # (refused twice, still ours when read: the next beat writes it)

    def release(self, writes_ended: bool = False) -> None:
        """Give the lease back (only if we still hold it, and its `finishing` writes ended)."""
        if not self.held or (self.finishing and not writes_ended):
            return
        self._stop.set()
        if self._thread is not None:
            # A beat past its stop check lands before the file goes, never after it (a lease held
            # by nobody for a whole timeout); a write that hangs is not waited for long.
            self._thread.join(timeout=10)
        try:
            for _ in range(3):  # (refused: a late beat of ours landed since the read)
                current, version = self.file.read()
                if not current or current.get("token") != self.token:
                    break
                if self.file.remove_if(version):
                    break
        finally:
            self.token, self.finishing = None, None
