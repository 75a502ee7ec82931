"""A job's checkpoint directory as files: which steps are committed, a step's metadata,
moving torn steps aside and waiting for a new step.

Orbax writes the steps (`prefect_jax.training.checkpoints`); the readers here look at the
directory itself (local, or ``gs://`` for the metadata), so an evaluator, a command or a test
can ask without opening a checkpoint manager.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable

from prefect_jax.training.checksums import ORBAX_COMMIT_FILE
from prefect_jax.training.names import STEP_META_FILE

logger = logging.getLogger("prefect_jax.checkpoints")

# The items of every step; a step is committed once each has its directory.
ITEMS = ("state", "data", "meta")


def read_meta_file(checkpoint_dir: str, step: int) -> dict:
    """A step's metadata item read as a file (`names.STEP_META_FILE`: local or gs://), not
    through Orbax's restore."""
    from etils import epath

    return json.loads((epath.Path(checkpoint_dir) / str(int(step)) / STEP_META_FILE).read_text())


def is_committed(step_dir: str) -> bool:
    """A step directory counts once Orbax finalized it: the step's commit metadata file (written
    last, after every item) and every item directory are there."""
    return os.path.isfile(os.path.join(step_dir, ORBAX_COMMIT_FILE)) and all(
        os.path.isdir(os.path.join(step_dir, item)) for item in ITEMS
    )


def step_dirs(checkpoint_dir: str) -> list[int]:
    """Every integer-named directory, committed or not (what Orbax itself would call a step)."""
    try:
        names = os.listdir(checkpoint_dir)
    except FileNotFoundError:
        return []
    return sorted(
        int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(checkpoint_dir, n))
    )


def committed_steps(checkpoint_dir: str) -> list[int]:
    """Committed steps under a checkpoint directory, oldest first."""
    return [
        s for s in step_dirs(checkpoint_dir) if is_committed(os.path.join(checkpoint_dir, str(s)))
    ]


def quarantine(checkpoint_dir: str, step: int, why: str) -> str:
    """Move a torn or unreadable step aside (``<step>.<why>-<time>``), where no reader counts it
    as a step.

    Kept, not deleted, so that nothing is lost that someone may want to inspect.
    """
    src = os.path.join(checkpoint_dir, str(step))
    dst = f"{src}.{why}-{int(time.time())}"
    os.replace(src, dst)
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
