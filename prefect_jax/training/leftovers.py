"""What killed processes leave in a job's local checkpoint directory or stage, and its removal.

Each of these is as large as a step, and nothing ever reads it again:

- an Orbax save killed part-way: ``<step>.orbax-checkpoint-tmp``, which Orbax removes only if it
  saves that same step again (a backup or a SIGTERM checkpoint falls on any step);
- a download killed part-way (`download_dir`): ``.<step>.download-<boot id>-<id>``;
- a directory moved aside to be deleted, whose deletion was cut short: ``.<name>.stale-<id>``.

Only the job's writer removes them, under the lease and with no save of its own in flight
(`JobCheckpoints.prepare_restore`). A download belongs to a process that may still run: an
evaluator downloading into the same stage, or this process's own prefetch. A download is named
for the machine's running kernel (its boot id, which every container of the machine shares) and
holds an exclusive lock on ``<its directory>.lock`` until it ends; the kernel drops the lock when
its process dies. One made under this kernel is removed once its lock can be taken: a lock tells
a dead process from a live one in any container, where process ids and host names do not. One
made elsewhere (another host sharing the folder over a network, the machine before a reboot, a
version before locks) cannot be asked, and is removed once it is a day old: no download takes a
day.

Everything is moved aside before it is deleted, so a process thought gone but still running
fails its own rename instead of committing a half-deleted step.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator

from prefect_jax.training.checkpoint_dirs import ORBAX_TMP_SUFFIX

UNOWNED_DOWNLOAD_AGE_SECS = 24 * 3600  # (see above)

_ORBAX_SAVE = re.compile(r"\d+" + re.escape(ORBAX_TMP_SUFFIX) + r"(-.*)?")
_DOWNLOAD = re.compile(r"\.\d+\.download-(?:(?P<owner>.+)-)?[0-9a-f]{12}")
_STALE = re.compile(r"\..+\.stale-[0-9a-f]{12}")
_live: set[str] = set()  # this process's downloads (locks of one process do not conflict on NFS)


@functools.cache
def _kernel() -> str:
    """This machine's running kernel: its boot id, else (no /proc) its host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")
    except OSError:
        return socket.gethostname()


def move_aside_and_remove(path: str) -> bool:
    """Delete directory `path` after renaming it out of the way. False if it was not there."""
    aside = os.path.join(
        os.path.dirname(path), f".{os.path.basename(path)}.stale-{uuid.uuid4().hex[:12]}"
    )
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True


@contextlib.contextmanager
def download_dir(local_dir: str, step: int) -> Iterator[str]:
    """A new hidden directory name under `local_dir` for a download of `step` before it takes the
    step's name, owned by this download (its lock held) until the block ends. The caller creates
    the directory, and renames or deletes it before the block ends."""
    while True:
        path = os.path.join(local_dir, f".{step}.download-{_kernel()}-{uuid.uuid4().hex[:12]}")
        _live.add(path)
        try:
            lock = open(f"{path}.lock", "w")
        except BaseException:
            _live.discard(path)
            raise
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # (a file system without locks: judged by its age)
            pass
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(lock.fileno()), os.stat(f"{path}.lock")):
                break
        # a cleanup took the new file for a killed download's before it was locked: a new name
        lock.close()
        _live.discard(path)
    try:
        yield path
    finally:  # (the name goes before the kernel releases the lock, at the close)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{path}.lock")
        lock.close()
        _live.discard(path)


def remove_leftovers(directory: str, downloads: bool = False) -> list[str]:
    """Remove what killed processes left in local `directory`: killed saves and asides; with
    `downloads` (a stage), also downloads whose process is gone. Returns the names removed."""
    if "://" in directory:  # (gs://: Orbax writes a step in place; a torn one is moved aside)
        return []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    removed = []
    for name in sorted(names):
        path = os.path.join(directory, name)
        if _ORBAX_SAVE.fullmatch(name):
            gone = move_aside_and_remove(path)
        elif _STALE.fullmatch(name):
            shutil.rmtree(path, ignore_errors=True)
            gone = True
        elif downloads and (match := _DOWNLOAD.fullmatch(name.removesuffix(".lock"))):
            gone = _remove_abandoned_download(name, directory, match["owner"])
        else:
            continue
        if gone:
            removed.append(name)
    return removed


def _remove_abandoned_download(name: str, directory: str, owner: str | None) -> bool:
    """Remove a download directory and its lock file (`name` is either) if its process is gone."""
    path = os.path.join(directory, name.removesuffix(".lock"))
    lock_path = f"{path}.lock"
    if path in _live:
        return False
    if owner != _kernel():
        return _remove_download_if_old(path, lock_path)
    try:
        lock = open(lock_path, "r+")  # (not created: its name going means its download ended)
    except FileNotFoundError:
        return _remove_download_if_old(path, lock_path)
    with lock:  # (held while removing: a new download that lost its file to us takes a new name)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its process runs
        except OSError:  # (a file system without locks)
            return _remove_download_if_old(path, lock_path)
        if not os.path.exists(lock_path):  # (ended between the open and the lock)
            return False
        return _remove_download(path, lock_path)


def _remove_download_if_old(path: str, lock_path: str) -> bool:
    """A download nobody can ask about: removed once the newer of its directory and lock file
    (those there) was last changed over `UNOWNED_DOWNLOAD_AGE_SECS` ago."""
    times = []
    for p in (path, lock_path):
        with contextlib.suppress(FileNotFoundError):
            times.append(os.stat(p).st_mtime)
    if not times or time.time() - max(times) <= UNOWNED_DOWNLOAD_AGE_SECS:
        return False
    return _remove_download(path, lock_path)


def _remove_download(path: str, lock_path: str) -> bool:
    removed = move_aside_and_remove(path)
    try:
        os.unlink(lock_path)
    except FileNotFoundError:
        return removed
    return True
