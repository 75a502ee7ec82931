"""What killed processes leave in a job's local checkpoint directory or stage, and its removal.

Each of these is as large as a step, and nothing ever reads it again:

- an Orbax save killed part-way: ``<step>.orbax-checkpoint-tmp``, which Orbax removes only if it
  saves that same step again (a backup or a SIGTERM checkpoint falls on any step);
- a download killed part-way (`download_dir`): ``.<step>.download-<host>-<id>``;
- a directory moved aside to be deleted, whose deletion was cut short: ``.<name>.stale-<id>``.

Only the job's writer removes them, under the lease and with no save of its own in flight
(`JobCheckpoints.prepare_restore`). A download belongs to a process that may still run: an
evaluator downloading into the same stage, or this process's own prefetch. Each download holds an
exclusive lock on ``<its directory>.lock`` until it ends, and the kernel drops the lock when its
process dies; a download is removed only once its lock can be taken. A lock tells a dead process
from a live one in any container of the machine, where process ids do not. A download from
another host (a stage shared over the network) is left alone.

Everything is moved aside before it is deleted, so a process that was thought gone but still
runs fails its own rename instead of committing a half-deleted step.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator

from prefect_jax.training.checkpoint_dirs import ORBAX_TMP_SUFFIX

# A download named by a version before 2026-12 (``.<step>.download-<id>``, no lock) is removed
# once this old: no download takes a day.
UNLOCKED_DOWNLOAD_AGE_SECS = 24 * 3600

_ORBAX_SAVE = re.compile(r"\d+" + re.escape(ORBAX_TMP_SUFFIX) + r"(-.*)?")
_DOWNLOAD = re.compile(r"\.\d+\.download-(?:(?P<host>.+)-)?[0-9a-f]{12}")
_STALE = re.compile(r"\..+\.stale-[0-9a-f]{12}")


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
    path = os.path.join(
        local_dir, f".{step}.download-{socket.gethostname()}-{uuid.uuid4().hex[:12]}"
    )
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (a new name: nobody else holds it)
        try:
            yield path
        finally:  # (the name goes before the kernel releases the lock, at the close)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{path}.lock")


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
            gone = _remove_abandoned_download(path, match["host"])
        else:
            continue
        if gone:
            removed.append(name)
    return removed


def _remove_abandoned_download(path: str, host: str | None) -> bool:
    """Remove a download directory, or its lone lock file, if its process is gone."""
    if host is None:  # (before locks: judged by its age)
        try:
            old = time.time() - os.stat(path).st_mtime > UNLOCKED_DOWNLOAD_AGE_SECS
        except FileNotFoundError:
            return False
        return old and move_aside_and_remove(path)
    if host != socket.gethostname():
        return False
    lock_path = path if path.endswith(".lock") else f"{path}.lock"
    try:
        lock = open(lock_path, "r+")  # (not created: its name going means its download ended)
    except FileNotFoundError:
        return False
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its process runs
        if not os.path.exists(lock_path):  # (ended between the open and the lock)
            return False
        if path != lock_path:
            move_aside_and_remove(path)
        os.unlink(lock_path)
    return True
