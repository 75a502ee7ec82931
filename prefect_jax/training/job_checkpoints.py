"""A job's checkpoints as its `Job` keeps them: Orbax's steps on local disk or ``gs://``, or a
local stage whose steps count once uploaded (`prefect_jax.training.remote`); the upload after each
save, retention of the remote copies, and the commit listeners told once a step counts.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from collections.abc import Callable
from typing import Any

from prefect_jax.training.checkpoint_dirs import is_committed, step_dirs
from prefect_jax.training.checksums import CorruptCheckpointError
from prefect_jax.training.cluster import barrier
from prefect_jax.training.errors import CheckpointSaveError
from prefect_jax.training.leftovers import remove_leftovers
from prefect_jax.training.mlflow_client import exit_wait
from prefect_jax.training.peer_watch import LostProcess
from prefect_jax.training.policy import retained
from prefect_jax.training.step_prefetch import wait as wait_for_prefetch
from prefect_jax.training.uploader import AsyncUploader

logger = logging.getLogger("prefect_jax.trainer")


class JobCheckpoints:
    """Saving, listing, restoring and uploading a job's steps (part of `Job`, which sets
    ``checkpoints``, ``remote``, ``_uploader``, ``processes``, ``is_primary`` and the rest)."""

    def committed_steps(self) -> list[int]:
        """The job's committed steps: on its storage (remote steps count once uploaded)."""
        return (
            self.remote.committed_steps()
            if self.remote is not None
            else self.checkpoints.committed_steps()
        )

    def is_committed(self, step: int) -> bool:
        """Whether `step` counts: `step in committed_steps()`, asked of that step alone. On remote
        storage: known without a request for a step this process uploaded (and its retention did
        not remove since); else one request for its commit marker, not a listing and one per
        step."""
        if self.remote is None:
            return int(step) in self.checkpoints.committed_steps()
        if self._uploader is not None and self._uploader.committed(step):
            return True
        return self.remote.is_committed(step)

    def newest_committed(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def prepare_restore(self) -> list[int] | None:
        """The writer's view after a crash: torn local steps moved aside and killed saves'
        temporaries removed; for remote storage, partial uploads removed, staged steps that never
        got uploaded dropped (they do not count) and downloads killed part-way removed.
        Returns the committed remote steps it listed (oldest first), where no upload of this
        process is in flight: the restore need not list them again (a listing and a request per
        step on object storage); else None."""
        try:
            self.checkpoints.wait()
        except CheckpointSaveError as exc:
            logger.warning("%s", exc)  # the restore resumes from the committed steps
        self.checkpoints.forget_failed_save()
        if self.processes > 1:
            if self.is_primary:  # the others wait, then see what it left
                self.checkpoints.quarantine_uncommitted()
                self._remove_killed_copies()
            barrier("prefect_jax.prepare_restore")
            self.checkpoints.reload()
            return None
        self._remove_killed_copies()
        if self.remote is None:
            self.checkpoints.quarantine_uncommitted()
            return None
        pending = set(self._uploader.pending) if self._uploader is not None else set()
        committed: list[int] = []
        for step in self.remote.delete_uncommitted(
            keep=lambda s: s in pending, committed=committed
        ):
            logger.warning(
                "checkpoint step %d at %s was never committed: removed", step, self.remote.safe_url
            )
        for step in step_dirs(self.checkpoints.directory):
            if step not in committed and step not in pending:
                shutil.rmtree(
                    os.path.join(self.checkpoints.directory, str(step)), ignore_errors=True
                )
        self.checkpoints.reload()
        return None if pending else committed

    def _remove_killed_copies(self) -> None:
        """Remove the partial saves and downloads of killed processes from the local directory:
        each as large as a step, never read again (the writer's, with no save in flight)."""
        directory = self.checkpoints.directory
        if removed := remove_leftovers(directory, downloads=self.remote is not None):
            logger.warning(
                "removed what killed saves or downloads left in %s: %s", directory, removed
            )

    def fetch(self, step: int) -> None:
        """Make a committed remote step readable in the local stage (download it unless it is
        there)."""
        if self.remote is None:
            return
        wait_for_prefetch(self.checkpoints.directory)  # one download of a step at a time
        if step in self.checkpoints.committed_steps():
            return
        self.remote.download(step, self.checkpoints.directory)
        self.checkpoints.reload()

    def restore(self, step: int, abstract_state, data_iter=None):
        """Restore a committed step (downloaded first if remote): ``(state, metadata)``."""
        self.checkpoints.wait()
        self.fetch(step)
        return self.checkpoints.restore(step, abstract_state, data_iter)

    def read_meta(self, step: int) -> dict:
        if self.remote is not None and step not in self.checkpoints.committed_steps():
            # (not the whole step: an evaluator skipping backups reads this)
            return self.remote.read_meta(step)
        return self.checkpoints.read_meta(step)

    def set_aside(self, step: int, exc: BaseException) -> None:
        """A step that failed to restore: move it aside (local), or drop its local copy (remote:
        the remote step stays for someone to inspect). With several processes, process 0 does."""
        if not self.is_primary:
            return
        if self.remote is None:
            self.checkpoints.quarantine(
                step, "corrupt" if isinstance(exc, CorruptCheckpointError) else "unreadable"
            )
        else:
            shutil.rmtree(os.path.join(self.checkpoints.directory, str(step)), ignore_errors=True)
            self.checkpoints.reload()

    def save(
        self,
        step: int,
        state,
        data_iter,
        meta: dict[str, Any],
        while_committing: Callable[[], None] | None = None,
    ) -> None:
        """Start an asynchronous save of `step`; upload it when it commits (remote storage); tell
        the commit listeners once it counts (not of a backup: nobody evaluates it). Where the
        commit is waited for here (below), `while_committing()` runs first, as Orbax writes."""
        self.checkpoints.save(
            step,
            state,
            data_iter,
            {**meta, "host": socket.gethostname(), "pid": os.getpid(), **self.run_tags},
        )
        if self.config.train.is_final(step) or self.checkpoints.failures.save_waits:
            # The final step (or the first save after one failed): its commit is waited for here,
            # so that a save that fails (a full disk) fails the training task that made it, not
            # an evaluation after it, nor the next interval, whose retry would start it again.
            if while_committing is not None:
                while_committing()
            self.checkpoints.wait()
            self.checkpoints.failures.save_waits = False
        if self.remote is not None:
            self.uploader.submit(
                step, os.path.join(self.checkpoints.directory, str(step)), ready=is_committed
            )
        # one event per step, however many processes wrote it
        if self.commit_listeners and self.is_primary and not meta.get("backup"):
            self._announcer.submit(step)

    def wait_uploaded(self, until: Callable[[], bool]) -> None:
        """On object storage, wait for the uploads in flight, raising one that failed after the
        uploader's own retries, or until `until()` (a SIGTERM came: its handling waits for them
        within its grace). For the final step, in the training task that saved it: S3 refusing
        it for a minute then fails that task, which its retries cover, not the flow's end, which
        none do."""
        if self.remote is None:
            return
        while not self.uploader.wait(timeout=0.25):
            if until():
                return

    def _announce_commit(self, step: int) -> None:
        """Tell the commit listeners once `step` is committed (from a background thread)."""
        try:
            self.checkpoints.wait()
        except CheckpointSaveError:
            return  # not committed: nothing to tell (the training's next save raises it)
        # another process went away after its part: the step counts if process 0 committed it
        except LostProcess:
            pass
        if self.remote is not None and not self.uploader.wait_for(step, timeout=3600):
            return  # the upload failed (reported by the next save or finish), or is still not done
        if not self.is_committed(step):  # (not removed by retention since)
            return
        for fn in list(self.commit_listeners):
            try:
                fn(step)
            except Exception:  # noqa: BLE001 - a listener must not break training
                logger.exception("commit listener failed for step %d", step)

    def uploading(self) -> bool:
        """Whether a step is still on its way to remote storage (queued or uploading)."""
        return self._uploader is not None and bool(self._uploader.pending)

    def save_landed(self) -> bool:
        """Whether no save is in flight (a check that does not wait): Orbax finished every save
        started so far (committed, or failed) and, on remote storage, every upload is done."""
        return not self.checkpoints.saving() and not self.uploading()

    def wait_committed(
        self, ending: bool = False, events_wait: float = 30.0, uploads_wait: float | None = None
    ) -> None:
        """Wait until every save started so far counts: committed by Orbax, and uploaded if remote.
        `ending` (an attempt that did not finish): a save that another process, gone, never
        completes is left as it is (`peer_watch.LostProcess` otherwise). `events_wait`: how long
        the saves' commit events may take to go out after that; `uploads_wait`: how long the
        uploads in flight may take (None: until they land or fail)."""
        try:
            self.checkpoints.wait()
        except CheckpointSaveError:
            # The step did not commit (evaluations and exports find so). The failure is the
            # training's: kept in `checkpoints.failures`, raised by its next save.
            pass
        except LostProcess as exc:
            if not ending:
                raise
            # the trainer's finish and the job's each end here: one warning
            if self._left_in_flight is None:
                self._left_in_flight = str(exc)
                logger.warning("not waiting for the save in flight: %s", exc)
        if self._uploader is not None:
            self._uploader.wait(timeout=uploads_wait)
        self._announcer.wait(timeout=exit_wait(events_wait))  # their commit events are out too

    def wait_ended(self, status: str) -> None:
        """`wait_committed` for an attempt that ends with `status`. KILLED: SIGTERM's handler
        waited for the save in flight and its commit event within its grace, and said what it
        abandoned; an upload still going (S3 refusing it), and the commit event that waits for it,
        are not waited for again (the runner's SIGKILL would come first)."""
        if status == "KILLED" and self.uploading():
            self.wait_committed(ending=True, events_wait=0.0, uploads_wait=0.0)
        else:
            self.wait_committed(ending=status != "FINISHED")

    @property
    def uploader(self) -> AsyncUploader | None:
        if self.remote is not None and self._uploader is None:
            self._uploader = AsyncUploader(self.remote, on_uploaded=self._uploaded)
        return self._uploader

    def retention_reads(
        self,
    ) -> tuple[int | None, Callable[[int], bool], Callable[[int], float | None]]:
        """What retention reads of the job's steps (`policy.retained`'s arguments after the
        spec): the newest evaluated step, whether a step is a backup and when it was saved (by
        the remote copies' metadata, where the job's steps are remote)."""
        read_meta = self.remote.read_meta if self.remote is not None else None
        return (
            self.newest_evaluated(),
            lambda s: self.checkpoints.is_backup(s, read_meta),
            lambda s: self.checkpoints.saved_at(s, read_meta),
        )

    def _uploaded(self, step: int) -> None:
        """After an upload: apply retention to the remote steps, keep only the newest locally."""
        self.remote.retain(
            lambda steps: retained(steps, self.config.checkpoint, *self.retention_reads()),
            but=step,
            deleting=lambda old: self._uploader.forget([old]),
        )
        for old in step_dirs(self.checkpoints.directory):
            if old < step and old not in self._uploader.pending:
                shutil.rmtree(
                    os.path.join(self.checkpoints.directory, str(old)), ignore_errors=True
                )
