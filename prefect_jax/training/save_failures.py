"""A failed checkpoint save, as each thread that waits for it sees it.

Orbax raises a failed async save to each thread that waits for it, once. `Checkpoints` has more
than one thing that can see the failure first: its own wait, the wait of a save handed off to a
thread (`save_handoff`), a metadata read, the commit announcer's thread. Whichever sees it, the
failure must still reach the training thread's next wait, and every later save must refuse to
start: a step that did not commit must fail the training. That bookkeeping lives here.
"""

from __future__ import annotations

import logging
import threading

from prefect_jax.training.errors import CheckpointSaveError

logger = logging.getLogger("prefect_jax.checkpoints")


class SaveFailures:
    """The failed saves of one checkpoint directory.

    Attributes:
        first: the first save that failed since the last restore (None: none); every later save
            raises it.
        save_waits: the next save is to be waited for where it is made (set by `forget`): a
            storage that still refuses writes then fails that training task, not the one after.
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.first: CheckpointSaveError | None = None
        self.save_waits = False
        self._raised = threading.local()  # per thread: the failures already raised to it

    def record(self, step: int | None, exc: BaseException) -> CheckpointSaveError:
        """`exc`, the failure of the save of `step`, as it is raised; the first one kept (and
        logged) in `first`."""
        failed = CheckpointSaveError(step, self.directory, exc)
        if self.first is None:
            self.first = failed
            logger.error("%s", failed)
        return failed

    def first_time_here(self, exc: BaseException) -> bool:
        """Whether this thread is seeing `exc` raised for the first time (and, from now on, has)."""
        raised = self._raised.__dict__.setdefault("errors", [])
        if any(exc is seen for seen in raised):
            return False
        raised.append(exc)
        return True

    def raise_first(self) -> None:
        """Raise the first failure since the last restore, if any (a save must not start)."""
        if self.first is not None:
            raise self.first

    def forget(self) -> None:
        """A restore starts over from the committed steps: the failure is behind it, and the next
        save is waited for where it is made (`save_waits`)."""
        if self.first is not None:
            self.save_waits = True
        self.first = None
