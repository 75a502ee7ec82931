"""The lease record's reads and writes (`prefect_jax.training.lease`), each write made only over
the record its writer read last (a compare-and-set) where the storage can refuse it otherwise.

A heartbeat is a read and then a write, and so is a takeover. Between the two another trainer
may write: a takeover of a holder whose beat was slow to land (a stalled PUT, a long pause), or
a holder's mark that it is finishing a save. Written plainly, the later write wins: a lost
holder's late beat lands over its taker's record, the taker stops at its next checkpoint and the
old holder, which should have stopped, trains on; a finishing mark that lands just before a
takeover's write is written over, and the taker does not wait for that save. Written over the
record read only, the late writer is refused, reads again, and judges what it finds: a holder
finds the job taken and stops before its next checkpoint; a taker finds the mark and waits.

- Local paths (and shared file systems whose locks hold across machines): the compare and the
  write are made under an exclusive ``flock`` of ``<storage>/.<job>.lease.lock``, which every
  writer of the lease takes. Beside the job's folder, not in it: a folder made anew (a remount)
  stays empty, and a refused job's empty folder can go (`lease_early.release_early`).
- Object stores: S3 (``s3://``, ``s3a://``), ``PutObject`` with ``If-Match`` the ETag read
  (``If-None-Match: *`` where there was no lease); Google Cloud Storage (``gs://``), an upload
  with ``ifGenerationMatch`` the generation read (0 where there was none). Each refuses a write
  over an object that changed since (`prefect_jax.training.object_preconditions`).
- Elsewhere (Azure, ...), on a zonal GCS bucket (its objects appendable ones, which the JSON API
  cannot upload), and where a store or file system refuses the precondition itself, the
  write is plain, said once: the holder's check before each checkpoint (`Lease.verify`) and the
  takeover's read-back (`lease_takeover`) are the fence, as they were before this.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from prefect_jax.training.object_preconditions import PreconditionUnsupported, preconditions_for
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.storage import JobStorage, atomic_write, json_bytes

logger = logging.getLogger("prefect_jax.lease")

# Where `flock` is refused, or not implemented (Lustre without its flock option): plain writes.
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)
_said_plain: set[str] = set()  # the storage roots whose plain writes were said (once each)


class LeaseFile:
    """The lease file of one job: `read` gives the record and its version, `write_if` writes a
    record only where the file is still at the version read (see the module).

    Args:
        storage: the job's storage.
        path: the lease file's path in it.
    """

    def __init__(self, storage: JobStorage, path: str):
        self.storage, self.path = storage, path
        self.local = storage.protocol == "file"
        # (None where the store takes no precondition, or once it refused one)
        self.objects = preconditions_for(storage.protocol)

    @property
    def conditional(self) -> bool:
        """Whether a write here lands only over the record read (else it is plain)."""
        return self.local or self.objects is not None

    def read(self) -> tuple[dict | None, Any]:
        """The record (None: no lease; a torn one as `_torn` says) and its version, what
        `write_if` compares: the object's ETag or generation, else the record itself."""
        if self.objects is None:
            record = self._read_record()
            return record, record
        try:
            data, version = self.objects.read(self.storage.fs, self.path)
        except PreconditionUnsupported as exc:
            self._unsupported(exc)
            return self.read()
        return (None if data is None else self._decode(data)), version

    def write_if(self, record: dict, version: Any, make_parent: bool = False) -> bool:
        """Write `record` where the lease is still at `version` (`read`'s; None: where there is
        no lease); False, writing nothing, where another write came since. `make_parent`: make
        the job's directory where it is missing (a new lease; a heartbeat never makes it again:
        `Lease.write_beat`)."""
        if self.local:
            with self._locked(make_parent) as locked:
                if locked and self._read_record() != version:
                    return False
                if make_parent:
                    self.storage.write_json(self.path, record)
                else:
                    atomic_write(self.path, json_bytes(record))
                return True
        if self.objects is not None:
            try:
                return self.objects.put_if(self.storage.fs, self.path, json_bytes(record), version)
            except PreconditionUnsupported as exc:
                self._unsupported(exc)
        else:
            self._say_plain("its storage takes no precondition on a write")
        self.storage.write_json(self.path, record)
        return True

    def remove_if(self, version: Any) -> bool:
        """Remove the lease where it is still at `version`; False where another write came since
        (on an object store a delete with its precondition; where the storage has none, the
        caller's read is the only check). A lease already gone is removed."""
        try:
            if self.objects is not None and version is not None:
                try:
                    return self.objects.delete_if(self.storage.fs, self.path, version)
                except PreconditionUnsupported as exc:  # (its writes still take it)
                    self._say_plain(f"its delete: {exc}", logging.WARNING)  # (removed below)
            with self._locked(False) if self.local else contextlib.nullcontext(False) as locked:
                if locked and self._read_record() != version:
                    return False
                self.storage.fs.rm(self.path)
        except FileNotFoundError:  # (freed by a late writer meanwhile, or its folder gone)
            pass
        return True

    def _unsupported(self, exc: PreconditionUnsupported) -> None:
        self.objects = None  # (its next writes plain, said once)
        self._say_plain(str(exc), logging.WARNING)  # (a store that was expected to take it)

    # -- local ---------------------------------------------------------------------------

    @property
    def lock_path(self) -> str:
        """``<storage>/.<job>.lease.lock``: what every local writer of the lease locks."""
        return os.path.join(self.storage.root, f".{self.storage.job}.lease.lock")

    @contextlib.contextmanager
    def _locked(self, make_parent: bool) -> Iterator[bool]:
        """Hold `lock_path` exclusively; yields whether it is held (False where the file system
        refuses locks: said once, and the write is plain). `make_parent`: make the job's folder
        (and the storage's) first; else a storage folder gone raises FileNotFoundError."""
        if make_parent:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        try:  # (0o666 less the umask: a job folder a group shares is locked by each user)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:  # (another user's lock file: an exclusive flock needs no write)
            fd = os.open(self.lock_path, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    raise
                self._say_plain(f"its file system refuses locks ({exc.strerror})")
                yield False
                return
            yield True
        finally:
            os.close(fd)  # (the lock goes with it)

    def _read_record(self) -> dict | None:
        try:
            return self.storage.read_json(self.path)
        except ValueError:  # (json's and UTF-8's decode errors)
            return self._torn()

    def _decode(self, data: bytes) -> dict:
        import json

        try:
            return json.loads(data)
        except ValueError:
            return self._torn()

    def _torn(self) -> dict:
        """A torn record (a write cut short, bit rot) is held by a trainer nobody can name:
        ``{"torn": <path>, "heartbeat": <its mtime>}``, so it keeps the job until it goes stale
        as any lease does, by its last write and the timeout. Read as none, it would let a second
        trainer take a live job silently."""
        try:
            written = self.storage.fs.modified(self.path).timestamp()
        except (OSError, NotImplementedError, ValueError):
            written = time.time()  # no time to go by: held for a whole timeout from now
        return {"torn": redact_url(self.path), "heartbeat": written}

    def _say_plain(self, why: str, level: int = logging.INFO) -> None:
        if self.storage.root not in _said_plain:
            _said_plain.add(self.storage.root)
            logger.log(
                level,
                "the lease of %s is written without a compare-and-set: %s. A holder's late "
                "heartbeat can land over a takeover (the checks before each checkpoint still "
                "stop the holder that lost it): docs/preemption.md",
                redact_url(self.storage.job_dir),
                why,
            )
