"""Orbax checkpoints of one job: train state, Grain iterator state and metadata in one step.

A step counts only once it is committed (Orbax finalized it). Saves are asynchronous:
`save` returns as soon as the arrays are copied off the device, and the write goes on in
the background while training continues. Reading the directory without a manager (committed
steps, a step's metadata, torn steps) is `prefect_jax.training.checkpoint_dirs`'s.

`IteratorHandler`'s path, ``prefect_jax.training.checkpoints.IteratorHandler``, is written into
every step's Orbax metadata: it stays defined here, or old steps would not restore.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from prefect_jax.training import cluster
from prefect_jax.training.checkpoint_dirs import (
    committed_steps,
    is_committed,
    quarantine,
    read_meta_file,
    step_dirs,
    write_manifest_in_commit,
)
from prefect_jax.training.checksums import BackgroundVerification
from prefect_jax.training.data_positions import (
    position_text,
    positions_explained,
    restore_position_of_process_0,
    written_by_other_processes,
)
from prefect_jax.training.errors import (
    CheckpointMismatchError,
    CheckpointSaveError,
    IntactStepRestoreError,
)
from prefect_jax.training.policy import CheckpointPolicy
from prefect_jax.training.save_failures import SaveFailures
from prefect_jax.training.save_handoff import (
    HandOff,
    copy_for_save,
    copy_has_room,
    device_copy_enabled,
)
from prefect_jax.training.specs import CheckpointSpec
from prefect_jax.training.trees import (
    abstract_savable,
    describe_tree,
    from_savable,
    to_savable,
    tree_differences,
)

logger = logging.getLogger("prefect_jax.checkpoints")


# -- the manager ------------------------------------------------------------------------


class IteratorHandler(grain.checkpoint.CheckpointHandler, ocp.AsyncCheckpointHandler):
    """Grain's iterator item, its file written in the save's commit instead of before `save`
    returns.

    Grain's handler is synchronous, so Orbax ran its one small write on a thread that the save
    waited for, behind the creation of every item's directory: a large share of a small
    three-item save's blocking time. Here the position is read at the save (the iterator moves
    on after it) and written by a commit future, as Orbax's JSON item is. The same file
    (``process_<i>-of-<n>.json``, Grain's text), restored by Grain's own code: steps written
    before or after this read the same either way. A public name: it is recorded in each step's
    ``_CHECKPOINT_METADATA`` (Orbax's handler registry takes one class per name, so it cannot
    borrow Grain's)."""

    async def async_save(self, directory, args):
        # (a position read already: a save handed off to a thread, `Checkpoints.save`)
        text = args.item if isinstance(args.item, str) else position_text(args.item)
        index, count = jax.process_index(), jax.process_count()

        async def write():
            (directory / f"process_{index}-of-{count}.json").write_text(text)

        return [
            ocp.future.CommitFutureAwaitingContractedSignals(write(), name="prefect_jax_data_save")
        ]


@ocp.args.register_with_handler(IteratorHandler, for_save=True)
@dataclasses.dataclass
class IteratorSave(ocp.args.CheckpointArgs):
    """Save a Grain iterator's position (the ``data`` item) with `IteratorHandler`."""

    item: Any


@ocp.args.register_with_handler(IteratorHandler, for_restore=True)
@dataclasses.dataclass
class IteratorRestore(ocp.args.CheckpointArgs):
    """Set a Grain iterator to the position a step saved (the ``data`` item)."""

    item: Any


def _handlers():
    return {
        "state": ocp.StandardCheckpointHandler(),
        "data": IteratorHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }


class Checkpoints:
    """Orbax CheckpointManager for one job, with the commit rule and tree checks of this project.

    Each step carries a manifest of its files' checksums, written in Orbax's commit (after the
    items are final, before the step directory is renamed into place), and checked on restore.

    Args:
        directory: absolute local path (or ``gs://`` URL) of the job's checkpoints.
        spec: cadence and retention (retention: `CheckpointPolicy.preservation`).
        read_only: open an existing directory for restore only (no directory creation).
        newest_evaluated: with `spec.keep_until_evaluated`, returns the newest evaluated step
            (None: none yet); retention keeps every step newer than it.

    Raises:
        ValueError: `spec.device_copy` is True with several JAX processes.
    """

    def __init__(
        self,
        directory: str,
        spec: CheckpointSpec | None = None,
        read_only: bool = False,
        newest_evaluated: Callable[[], int | None] | None = None,
    ):
        spec = spec or CheckpointSpec()
        self.directory, self.spec = directory, spec
        self._saving: int | None = None
        # A save that did not commit must fail the training, whichever thread saw Orbax's error
        # first: every later save raises it, until a restore.
        self.failures = SaveFailures(directory)
        self._facts: dict[int, dict] = {}  # step -> what retention reads of it (`_facts_of`)
        # Saves handed to a thread behind a copy on the device (`save_handoff`); the one in flight
        self.device_copy = not read_only and device_copy_enabled(spec.device_copy)
        self._copy_room_seen = spec.device_copy is not None  # (left to choose: at the first save)
        self._handoff = HandOff()
        self.pinned: Callable[[int], bool] = lambda step: False  # kept for now (`Job`: uploads)
        retention = CheckpointPolicy.from_spec(spec).preservation(
            self.is_backup, lambda s: self.pinned(s), newest_evaluated, self.saved_at
        )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=retention,
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(
                post_finalization_callback=self._checksum_step_in_flight
            ),
            # Retention's deletions run in the commit, which the next save waits for. Left to
            # Orbax, a machine of 4 or more CPUs deletes each local step with a thread pool whose
            # scheduler polls its queue every 0.1 s, so each deleted step waits for a poll, where
            # one thread's rmtree is far quicker.
            num_deletion_threads=1,
            create=not read_only,
            read_only=read_only,
        )
        self.manager = ocp.CheckpointManager(directory, item_handlers=_handlers(), options=options)

    def _checksum_step_in_flight(self) -> None:
        """Orbax calls this on its save thread once the items are final and before the step's
        temporary directory becomes ``<step>``: the manifest is part of the same commit."""
        if self._saving is None or "://" in self.directory or jax.process_index() != 0:
            # Several processes: process 0 finalizes the step, once every process wrote its part.
            return
        write_manifest_in_commit(self.directory, self._saving)

    def committed_steps(self) -> list[int]:
        return committed_steps(self.directory)

    def is_backup(self, step: int, read_meta: Callable[[int], dict] | None = None) -> bool:
        return bool(self._facts_of(step, read_meta).get("backup"))

    def saved_at(self, step: int, read_meta: Callable[[int], dict] | None = None) -> float | None:
        return self._facts_of(step, read_meta).get("saved_at")  # (epoch seconds; None: unknown)

    def _facts_of(self, step: int, read_meta: Callable[[int], dict] | None) -> dict:
        """A committed step's ``backup`` and ``saved_at`` for retention: known for the steps
        saved here, else read by `read_meta` (default: this directory's file: retention asks
        from inside Orbax's `save`) and kept once read; unreadable: neither, asked again."""
        step = int(step)
        if step not in self._facts:
            try:
                meta = (read_meta or (lambda s: read_meta_file(self.directory, s)))(step)
            except Exception:  # noqa: BLE001 - retention treats it as any step
                return {}
            self._facts[step] = {k: meta.get(k) for k in ("backup", "saved_at")}
        return self._facts[step]

    def quarantine(self, step: int, why: str) -> None:
        """Move a step aside (see `checkpoint_dirs.quarantine`) and let Orbax forget it. Only the
        job's writer may do this."""
        self._join_handoff(raising=False)
        self.manager.wait_until_finished()
        dst = quarantine(self.directory, step, why)
        logger.warning(
            "checkpoint step %d of %s moved aside to %s (%s)", step, self.directory, dst, why
        )
        self.reload()

    def quarantine_uncommitted(self) -> None:
        """Move aside integer directories without a commit (a save killed part-way)."""
        for step in step_dirs(self.directory):
            # Each looked at as it is now: a step committed since a list of committed steps was
            # made (a waiting trainer's, by the job's writer) is no torn one.
            if not is_committed(os.path.join(self.directory, str(step))):
                logger.warning(
                    "checkpoint step %d in %s was never committed: skipping it",
                    step,
                    self.directory,
                )
                self.quarantine(step, "uncommitted")

    def save(self, step: int, state, data_iter, meta: dict) -> None:
        """Start an asynchronous save of `state`, the iterator position and `meta` at `step`.
        With `device_copy`, of a copy of `state` on its devices, given to Orbax on a thread."""
        savable = to_savable(state)
        meta = dict(meta, step=int(step), tree=describe_tree(savable), saved_at=time.time())
        self.wait()  # Orbax does too; here, so that `_saving` names the step in flight
        self.failures.raise_first()
        self._saving = int(step)
        self._facts[int(step)] = {k: meta.get(k) for k in ("backup", "saved_at")}
        if self.device_copy and not self._copy_room_seen:
            self._copy_room_seen = True
            self.device_copy = copy_has_room(int(step), savable)
        if self.device_copy:
            handed = copy_for_save(int(step), savable, data_iter)
            if handed is not None:
                copy, position = handed
                self._handoff.start(int(step), lambda: self._save(int(step), copy, position, meta))
                return
            self.device_copy = False  # (the copy failed: saved as before, from now on)
        self._save(int(step), savable, data_iter, meta)

    def _save(self, step: int, savable, data, meta: dict) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(savable),
                data=IteratorSave(data),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )

    def saving(self) -> bool:
        """Whether a save is in flight (handed off, or Orbax's not yet committed)."""
        return self._handoff.running() or self.manager.is_saving_in_progress()

    def _join_handoff(self, raising: bool = True) -> None:
        """Wait for the save handed off (if any) to be Orbax's. Its failure is recorded in
        `failures`, and where `raising` it is raised once to each thread that waits, as Orbax
        does."""
        failure = self._handoff.join()
        if failure is None:
            return
        failed = self.failures.record(*failure)
        if raising and self.failures.first_time_here(failure[1]):
            raise failed from failure[1]

    def reload(self) -> None:
        """Have Orbax list the steps again. On ``gs://`` its paths (`etils.epath`, gcsfs under
        it) cache each listing for the process's life: the cache is dropped first, else a step
        another process committed since (an evaluator's trainer's) never shows."""
        if "://" in self.directory:
            from etils.epath import backend

            backend.fsspec_backend.fs(self.directory).invalidate_cache()
        self._join_handoff(raising=False)  # (the manager is Orbax's again: its save returned)
        self.manager.reload()

    def read_meta(self, step: int) -> dict:
        self._join_handoff(raising=False)
        if int(step) not in self.manager.all_steps():
            self.reload()
        return self.manager.restore(
            int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )["meta"]

    def restore(self, step: int, abstract_state, data_iter=None) -> tuple[Any, dict]:
        """Restore `step` into the structure of `abstract_state` (from ``jax.eval_shape(init)``).

        Raises:
            CorruptCheckpointError: the step's files differ from the checksums of its commit.
            CheckpointMismatchError: the stored tree differs from `abstract_state`; the message
                lists every differing leaf by path.
            IntactStepRestoreError: the step's files match its checksums, and it failed anyway.
        """
        self._join_handoff(raising=False)
        if int(step) not in self.manager.all_steps():
            # Committed by another process after this manager listed the directory.
            self.reload()
        # The checksums beside the restore, consulted before anything it read is used or refused:
        # a damaged step (its metadata too) is corrupt, not another program's.
        local, step_dir = "://" not in self.directory, os.path.join(self.directory, str(step))
        verifying = BackgroundVerification(step_dir) if local else None
        try:
            restored, meta = self._restore_unverified(step, abstract_state, data_iter)
        except Exception as exc:
            # result() raises for a damaged step, whatever the restore raised; True: intact
            if verifying is not None and verifying.result():
                if not isinstance(exc, CheckpointMismatchError):  # (another program's tree)
                    raise IntactStepRestoreError(step_dir, exc) from exc
            raise
        if local and not verifying.result():
            logger.warning(
                "checkpoint step %d in %s has no checksums (written before prefect-jax wrote "
                "them): restored unverified",
                step,
                self.directory,
            )
        return restored, meta

    def _restore_unverified(self, step: int, abstract_state, data_iter) -> tuple[Any, dict]:
        meta = self.read_meta(step)
        abstract = abstract_savable(abstract_state)
        diffs = tree_differences(meta.get("tree", {}), describe_tree(abstract))
        if diffs:  # (shallow leaves first: a model's own before its optimizer's copies of them)
            diffs = sorted(diffs, key=lambda d: d.split(":")[0].count("/"))
            shown = "\n  ".join(diffs[:20]) + (
                f"\n  ... and {len(diffs) - 20} more" if len(diffs) > 20 else ""
            )
            raise CheckpointMismatchError(
                f"checkpoint {self.directory}/{step} does not match the state the program's init "
                f"builds ({len(diffs)} leaves differ, below): the program changed since it was "
                "written. Restore it with the program that wrote it, or start a new job (a "
                f"different job name or storage).\n  {shown}",
                leaves=f"  {shown}",
            )
        items = {"state": ocp.args.StandardRestore(abstract)}
        other_layout = data_iter is not None and written_by_other_processes(self.directory, step)
        if data_iter is not None and not other_layout:
            items["data"] = IteratorRestore(data_iter)
        with positions_explained(data_iter, self.directory, step, other_layout):
            restored = self.manager.restore(int(step), args=ocp.args.Composite(**items))
            if other_layout:
                restore_position_of_process_0(data_iter, other_layout, step)
        return from_savable(restored["state"], abstract_state), meta

    def wait(self) -> None:
        """Wait until the save in flight (if any) is committed, or failed (its error is raised once
        to each thread that waits, as Orbax does, as `CheckpointSaveError`; kept in `failures`:
        every later `save` raises it). With several processes the commit is theirs together:
        `LostProcess` if one went away meanwhile (`cluster.wait_unless_lost`)."""
        try:
            self._join_handoff()
            self._wait_orbax()
        except (cluster.LostProcess, CheckpointSaveError):
            raise
        except Exception as exc:
            raise self.failures.record(self._saving, exc) from exc

    def forget_failed_save(self) -> None:
        """A restore starts over from the committed steps: the failed save (handed off or
        Orbax's) is behind it (`SaveFailures.forget`)."""
        self._handoff.join()
        self._handoff.forget()
        self.failures.forget()

    def _wait_orbax(self) -> None:
        if not cluster.several():
            self.manager.wait_until_finished()
            return
        try:
            cluster.wait_unless_lost(
                self.manager.wait_until_finished, f"the commit of step {self._saving}"
            )
        except cluster.LostProcess:
            raise
        except BaseException as exc:
            # The wait ran on a helper thread, a new one each time, to which Orbax raises a failed
            # save's error again: raise it once to this caller's thread, as Orbax itself would.
            if self.failures.first_time_here(exc):
                raise

    def close(self) -> None:
        try:
            self.wait()
        except cluster.LostProcess as exc:
            # Orbax's threads wait for it at their barriers until JAX aborts.
            logger.warning("not closing the checkpoints (%s): the job's committed steps stand", exc)
            return
        except CheckpointSaveError:
            self.manager.close()  # (Orbax raised the error to this thread once, in the wait)
            raise
        self.manager.close()
