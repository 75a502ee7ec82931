"""Copying one checkpoint step up to remote storage and down to a local cache.

An upload writes the step's files, checks their sizes, then writes the commit marker last; a
download lands in a temporary sibling that takes the step's name once whole.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid

from prefect_jax.training.leftovers import download_dir, move_aside_and_remove
from prefect_jax.training.names import COMMIT_MARKER
from prefect_jax.training.remote_errors import RemoteConfigError
from prefect_jax.training.remote_layout import (
    LOCAL_PROTOCOLS,
    OBJECT_STORE_PROTOCOLS,
    StepManifest,
    local_copy_matches,
    local_tree,
)
from prefect_jax.training.storage import atomic_write

logger = logging.getLogger("prefect_jax.remote")


class StepTransfers:
    """Upload and download of whole steps (part of `RemoteSteps`)."""

    def upload(self, step: int, local_step_dir: str, *, overwrite: bool = False) -> bool:
        """Copy one local step directory to ``<url>/<step>``, then write its commit marker.

        Idempotent: a step already committed is left alone (returns False) unless `overwrite`;
        a step left without a marker (an upload killed part-way) is removed and uploaded again.
        Until the marker is written no reader counts the step; when it is overwritten the
        marker is removed first.

        Returns:
            True when the step was uploaded, False when it was already committed.

        Raises:
            FileNotFoundError: `local_step_dir` is not a directory.
            RemoteUnreachableError, RemoteConfigError: see the class docstrings.
        """
        step = int(step)
        local = os.path.abspath(local_step_dir)
        if not os.path.isdir(local):
            raise FileNotFoundError(
                f"local checkpoint step {local} is not a directory: nothing to upload as step "
                f"{step}"
            )
        if self.is_committed(step):
            if not overwrite:
                logger.info(
                    "step %d is already committed in %s; not uploading it again",
                    step,
                    self.safe_url,
                )
                return False
            self._call(
                f"removing the commit marker of step {step}",
                self.fs.rm_file,
                self.marker_path(step),
            )
        dirs, files = local_tree(local)
        manifest = StepManifest(step, files, dirs, uuid.uuid4().hex, time.time())
        started = time.monotonic()
        if not self._flat:
            # an earlier, uncommitted upload (object stores: after the copy, below)
            self._remove_tree(step)
        target = self.step_path(step)
        lpaths = [os.path.join(local, *f.split("/")) for f in files]
        rpaths = [f"{target}/{f}" for f in files]
        # directories first, parents before children
        if self.protocol not in OBJECT_STORE_PROTOCOLS:
            lpaths = [local] + [os.path.join(local, *d.split("/")) for d in dirs] + lpaths
            rpaths = [target] + [f"{target}/{d}" for d in dirs] + rpaths
        try:
            self._call(f"uploading step {step} from {local}", self.fs.put, lpaths, rpaths)
        except FileNotFoundError as exc:
            if not os.path.isdir(local):
                raise FileNotFoundError(
                    f"local checkpoint step {local} disappeared while it was uploaded as step "
                    f"{step} (was it removed by local retention before its upload finished?); the "
                    "step is not committed"
                ) from exc
            raise RemoteConfigError(
                f"cannot write step {step} under {self.safe_url} ({self._cause(exc)}): check that "
                "the bucket or container exists and the URL is spelled right.",
                self.safe_url,
            ) from None
        self._verify_remote(step, manifest)
        self._write_marker(step, manifest)
        size = sum(files.values())
        logger.info(
            "uploaded step %d (%d files, %.1f MiB) to %s in %.1fs",
            step,
            len(files),
            size / 2**20,
            self.safe_url,
            time.monotonic() - started,
        )
        return True

    def _remove_tree(self, step: int, files: list[str] | None = None) -> None:
        """Remove a step's files: `files` where a listing named them all (object stores: removed
        in bulk without listing them again; none, nothing to do), else the step's directory."""
        path = self.step_path(step)
        self._invalidate(path)
        if files is not None and any(f.endswith("/") for f in files):
            # A "directory" key (some tools write them) is removed only by removing the tree.
            files = None
        try:
            if files is None:
                self._call(f"removing step {step}", self.fs.rm, path, recursive=True)
            elif files:
                self._call(f"removing step {step}", self.fs.rm, files)
        except FileNotFoundError:
            pass
        self._invalidate(path)

    def _remote_sizes(self, step: int) -> dict[str, int]:
        path = self.step_path(step)
        self._invalidate(path)
        try:
            found = self._call(f"listing the files of step {step}", self.fs.find, path, detail=True)
        except FileNotFoundError:
            return {}
        sizes = {}
        for name, info in found.items():
            rel = name[len(path) + 1 :] if name.startswith(path + "/") else name.rsplit("/", 1)[-1]
            if info.get("type", "file") != "directory" and rel != COMMIT_MARKER:
                sizes[rel] = int(info.get("size") or 0)
        return sizes

    def _verify_remote(self, step: int, manifest: StepManifest) -> None:
        """Check the copy against the manifest, before the marker makes it count. Files there that
        the manifest does not name were left by an earlier upload of this step that never committed
        (stopped part-way): removed now, from the same listing. (Listing first, before the copy,
        would cost a new step a LIST, a HEAD and another LIST on s3fs, which asks twice whether an
        empty prefix is a file or a directory.)"""
        remote = self._remote_sizes(step)
        stale = [f"{self.step_path(step)}/{f}" for f in remote if f not in manifest.files]
        if stale:
            self._call(f"removing what an earlier upload of step {step} left", self.fs.rm, stale)
            self._invalidate(self.step_path(step))
        bad = [f for f, size in manifest.files.items() if remote.get(f) != size]
        if bad:
            raise OSError(
                f"upload of step {step} to {self.safe_url} is incomplete after copying: {len(bad)} "
                f"file(s) missing or of the wrong size (first: {bad[0]}); it is not committed and "
                "will be uploaded again"
            )

    def _write_marker(self, step: int, manifest: StepManifest) -> None:
        path = self.marker_path(step)
        data = manifest.to_json()
        if self.protocol in LOCAL_PROTOCOLS and "::" not in self.url:
            atomic_write(path, data)
        else:
            self._call(f"writing the commit marker of step {step}", self.fs.pipe_file, path, data)
        self._invalidate(path)

    # -- download ----------------------------------------------------------------------------

    def download(self, step: int, local_dir: str) -> str:
        """Copy committed `step` to ``<local_dir>/<step>`` and return that path.

        The files land in a temporary sibling (`download_dir`, which Orbax does not take for a
        step) and are renamed into place once all are there with the sizes the marker
        records, so a reader never sees a partial step. A copy already there from the same upload
        is reused.

        Raises:
            FileNotFoundError: `step` is not committed here (the message lists those that are).
            OSError: a file came down with the wrong size (retry).
        """
        step = int(step)
        manifest = self.read_manifest(step)
        if manifest is None:
            raise FileNotFoundError(
                f"step {step} is not committed in {self.safe_url} (committed steps: "
                f"{self.committed_steps()}); a step counts once its upload wrote the commit marker"
            )
        local_dir = os.path.abspath(local_dir)
        os.makedirs(local_dir, exist_ok=True)
        target = os.path.join(local_dir, str(step))
        if manifest.upload_id and local_copy_matches(target, manifest):
            return target
        files = manifest.files or self._remote_sizes(step)
        started = time.monotonic()
        with download_dir(local_dir, step) as tmp:
            if not self._download_into(tmp, step, manifest, files, target):
                return target  # (another process's copy of the same upload, put there meanwhile)
        logger.info(
            "downloaded step %d (%d files, %.1f MiB) from %s to %s in %.1fs",
            step,
            len(files),
            sum(files.values()) / 2**20,
            self.safe_url,
            target,
            time.monotonic() - started,
        )
        return target

    def _download_into(
        self, tmp: str, step: int, manifest: StepManifest, files: dict[str, int], target: str
    ) -> bool:
        """`download`'s copy: the files into `tmp`, checked, marked, then renamed to `target`;
        False where another process put the same upload's copy there meanwhile (kept)."""

        def keep_theirs() -> bool:
            # another process put the same copy there meanwhile (a restore may be reading it)
            if not local_copy_matches(target, manifest):
                return False
            shutil.rmtree(tmp, ignore_errors=True)
            return True

        try:
            os.makedirs(tmp)
            for d in manifest.dirs:
                os.makedirs(os.path.join(tmp, *d.split("/")), exist_ok=True)
            for f in files:
                os.makedirs(os.path.dirname(os.path.join(tmp, *f.split("/"))), exist_ok=True)
            rpaths = [f"{self.step_path(step)}/{f}" for f in files]
            lpaths = [os.path.join(tmp, *f.split("/")) for f in files]
            if rpaths:
                self._call(f"downloading step {step}", self.fs.get, rpaths, lpaths)
            wrong = [
                f
                for f, size in files.items()
                if os.path.getsize(os.path.join(tmp, *f.split("/"))) != size
            ]
            if wrong:
                raise OSError(
                    f"download of step {step} from {self.safe_url}: {len(wrong)} file(s) came down "
                    f"with the wrong size (first: {wrong[0]}); retry the download"
                )
            with open(os.path.join(tmp, COMMIT_MARKER), "wb") as f:
                f.write(manifest.to_json())
            if manifest.upload_id and keep_theirs():
                return False
            if os.path.lexists(target):
                move_aside_and_remove(target)
            try:
                os.rename(tmp, target)
            except OSError:
                if keep_theirs():  # (another rename landed after the removal above)
                    return False
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return True

    def download_latest(self, local_dir: str) -> tuple[int, str] | None:
        """Download the newest committed step: ``(step, local path)``, or None when nothing is
        committed."""
        step = self.latest_committed()
        return None if step is None else (step, self.download(step, local_dir))
