"""A job's checkpoint directory as files: which steps are committed, a step's metadata,
moving torn steps aside and waiting for a new step.

Orbax writes the steps (`prefect_jax.training.checkpoints`); the readers here look at the
directory itself, so an evaluator, a command or a test can ask without opening a checkpoint
manager. On a local disk Orbax commits a step by renaming its temporary directory, and these
use `os`; on ``gs://``, where nothing renames, it writes ``commit_success.txt`` last in the step
(`GCS_COMMIT_FILE`), and these use `etils.epath` (Orbax's own paths: gcsfs underneath).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from collections.abc import Callable

from prefect_jax.training.checksums import write_manifest
from prefect_jax.training.names import GCS_COMMIT_FILE, ORBAX_COMMIT_FILE, STEP_META_FILE

logger = logging.getLogger("prefect_jax.checkpoints")

# The items of every step; a step is committed once each has its directory.
ITEMS = ("state", "data", "meta")
# How Orbax names a step being written on a local disk, ``<step><suffix>`` (``-<time>`` after it
# in older releases), renamed to ``<step>`` at the commit (its `atomicity_types.TMP_DIR_SUFFIX`).
# One a killed save left: `prefect_jax.training.leftovers`.
ORBAX_TMP_SUFFIX = ".orbax-checkpoint-tmp"


def write_manifest_in_commit(directory: str, step: int) -> None:
    """The checksums of `step`, a local step Orbax is committing: written into its temporary
    directory (once its items are final, before it becomes ``<step>``), so that they are part of
    the same commit."""
    found = glob.glob(os.path.join(glob.escape(directory), f"{step}{ORBAX_TMP_SUFFIX}*"))
    if len(found) == 1:
        write_manifest(found[0])
    else:
        logger.warning(
            "no single temporary directory for step %s in %s (%s): step saved without checksums",
            step,
            directory,
            found,
        )


def _url(path: str):
    """`path` as an `etils.epath.Path` where it is a URL (``gs://``), else None (a local path)."""
    if "://" not in path:
        return None
    from etils import epath

    return epath.Path(path)


def read_meta_file(checkpoint_dir: str, step: int) -> dict:
    """A step's metadata item read as a file (`names.STEP_META_FILE`: local or gs://), not
    through Orbax's restore."""
    from etils import epath

    return json.loads((epath.Path(checkpoint_dir) / str(int(step)) / STEP_META_FILE).read_text())


def step_of_dir(step_dir: str) -> int | None:
    """The step a step directory (``.../checkpoints/<step>``) names, or None."""
    name = os.path.basename(step_dir.rstrip("/"))
    return int(name) if name.isdigit() else None


def is_committed(step_dir: str) -> bool:
    """A step directory counts once Orbax finalized it: the step's commit metadata file (written
    last, after every item) and every item directory are there; on ``gs://``, its
    `GCS_COMMIT_FILE`."""
    url = _url(step_dir)
    if url is not None:
        return (url / GCS_COMMIT_FILE).exists()
    return os.path.isfile(os.path.join(step_dir, ORBAX_COMMIT_FILE)) and all(
        os.path.isdir(os.path.join(step_dir, item)) for item in ITEMS
    )


def step_dirs(checkpoint_dir: str) -> list[int]:
    """Every integer-named directory, committed or not (what Orbax itself would call a step)."""
    url = _url(checkpoint_dir)
    try:
        if url is not None:  # (a glob, not `iterdir`: gcsfs caches listings, not globs)
            return sorted(int(p.name) for p in url.glob("*") if p.name.isdigit())
        names = os.listdir(checkpoint_dir)
    except FileNotFoundError:
        return []
    return sorted(
        int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(checkpoint_dir, n))
    )


def committed_steps(checkpoint_dir: str) -> list[int]:
    """Committed steps under a checkpoint directory, oldest first."""
    url = _url(checkpoint_dir)
    if url is not None:  # one fresh listing, not a request per step
        found = (p.parent.name for p in url.glob(f"*/{GCS_COMMIT_FILE}"))
        return sorted(int(name) for name in found if name.isdigit())
    return [
        s for s in step_dirs(checkpoint_dir) if is_committed(os.path.join(checkpoint_dir, str(s)))
    ]


def quarantine(checkpoint_dir: str, step: int, why: str) -> str:
    """Move a torn or unreadable step aside (``<step>.<why>-<time>``), where no reader counts it
    as a step.

    Kept, not deleted, so that nothing is lost that someone may want to inspect. On ``gs://``
    there is no move: the step's commit file is deleted first, so that a move cut short leaves no
    step that counts; then its objects are copied (server-side) and deleted.
    """
    src = os.path.join(checkpoint_dir, str(step))
    dst = f"{src}.{why}-{int(time.time())}"
    url = _url(src)
    if url is None:
        os.replace(src, dst)
        return dst
    import fsspec

    (url / GCS_COMMIT_FILE).unlink(missing_ok=True)
    (fs, path), (_, to) = fsspec.core.url_to_fs(src), fsspec.core.url_to_fs(dst)
    fs.copy(path, to, recursive=True)
    fs.rm(path, recursive=True)
    return dst


def wait_for_new_checkpoint(
    list_steps: Callable[[], list[int]],
    after: int | None,
    timeout: float,
    poll_secs: float,
    log: Callable[[str], None] = logger.info,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int | None:
    """Poll until a committed step newer than `after` appears, or `timeout` seconds pass.

    Returns:
        The newest committed step, or None when the deadline passed without one.
    """
    deadline = clock() + timeout
    next_log = clock()
    while True:
        steps = [s for s in list_steps() if after is None or s > after]
        if steps:
            return steps[-1]
        left = deadline - clock()
        if left <= 0:
            return None
        if clock() >= next_log:  # say so at first, then every 30 s, not at every poll
            log(
                f"no committed checkpoint yet; waiting up to {left:.0f}s more "
                f"(polling every {poll_secs:g}s)"
            )
            next_log = clock() + 30
        sleep(min(poll_secs, left))


__all__ = [
    "ITEMS",
    "committed_steps",
    "is_committed",
    "quarantine",
    "read_meta_file",
    "step_dirs",
    "wait_for_new_checkpoint",
]
