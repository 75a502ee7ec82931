"""Checkpoint steps on any fsspec URL: upload with a commit marker written last, download to a
cache.

Orbax (0.12.8) writes checkpoints to local absolute paths and ``gs://`` only. For every other
protocol (``s3://``, ``az://``, ``memory://``, ...) a step is saved locally by Orbax first, then
copied with fsspec by `RemoteSteps.upload`, which writes the commit marker
``<step>/_PREFECT_JAX_COMMITTED`` after every other file. Only steps with the marker count:
an upload killed part-way leaves a step that no reader lists, and the next upload of that step
replaces it. `RemoteSteps.download` copies a committed step into a local cache directory
(into a temporary sibling, then one rename), where Orbax restores it.

`prefect_jax.training.uploader.AsyncUploader` runs uploads on one background thread, so
training goes on while a step is copied. Secrets never reach a message: see `redaction`.

Remote layout of one job's checkpoints::

    <url>/<step>/...                       the files of the Orbax step, as Orbax wrote them
    <url>/<step>/_PREFECT_JAX_COMMITTED    JSON manifest (files and sizes, upload id); written last

This module never imports prefect (nor jax); protocol packages (s3fs, gcsfs, adlfs) are
imported by fsspec when a URL needs them.

Example:
    ```python
    from prefect_jax.training.remote import RemoteSteps
    from prefect_jax.training.uploader import AsyncUploader

    remote = RemoteSteps("s3://bucket/runs/exp-1/checkpoints", {"key": "...", "secret": "..."})
    with AsyncUploader(remote) as uploader:
        uploader.submit(200, "/tmp/stage/exp-1/checkpoints/200")   # returns at once
        uploader.wait()                                           # raises what the upload raised
    print(remote.committed_steps())                               # [200]
    path = remote.download(200, "/tmp/cache/exp-1/checkpoints")   # .../checkpoints/200
    ```
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

import fsspec

from prefect_jax.training.names import COMMIT_MARKER, STEP_META_FILE
from prefect_jax.training.redaction import redact_url, scrub, secret_values
from prefect_jax.training.remote_errors import (
    ErrorTranslation,
    RemoteConfigError,
    RemoteStorageError,
    RemoteUnreachableError,
    first_line,
    transfer_may_succeed_again,
)
from prefect_jax.training.remote_layout import OBJECT_STORE_PROTOCOLS, StepManifest, protocol_of
from prefect_jax.training.remote_transfer import StepTransfers
from prefect_jax.training.storage import small_read

__all__ = [
    "RemoteConfigError",
    "RemoteStorageError",
    "RemoteSteps",
    "RemoteUnreachableError",
    "StepManifest",
    "first_line",
    "transfer_may_succeed_again",
]

logger = logging.getLogger("prefect_jax.remote")


class RemoteSteps(ErrorTranslation, StepTransfers):
    """Checkpoint steps in one remote directory on any fsspec URL, counted only once committed.

    Args:
        url: the job's checkpoint directory (``s3://bucket/prefix/job/checkpoints``, ``memory://x``,
            a local path, ...).
        storage_options: fsspec options for the protocol (credentials, ``client_kwargs``,
            ``config_kwargs``, ...). Never logged or shown unredacted.

    Raises:
        RemoteConfigError: the protocol is unknown, its package is not installed, or the options
            are refused; the message names the redacted URL.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None):
        if not isinstance(url, str) or not url.strip():
            raise RemoteConfigError(
                f"remote checkpoint URL {url!r} is empty: give a URL such as s3://bucket/prefix"
            )
        url = url.strip()
        if "://" not in url:
            url = os.path.abspath(os.path.expanduser(url))
        self.url = url.rstrip("/") or url
        self.protocol = protocol_of(self.url)
        self.safe_url = redact_url(self.url)
        self._options = dict(storage_options or {})
        self._secrets = secret_values(self.url, self._options)
        options = dict(self._options)
        if self.protocol in OBJECT_STORE_PROTOCOLS:
            # see steps committed by other processes
            options.setdefault("use_listings_cache", False)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        except Exception as exc:  # noqa: BLE001 - every construction failure becomes a clear error
            raise self._config_error(exc) from None
        self.root = self.root.rstrip("/")

    def __repr__(self) -> str:
        return f"RemoteSteps({self.safe_url!r})"

    # -- paths ---------------------------------------------------------------------------

    def step_path(self, step: int) -> str:
        return f"{self.root}/{int(step)}"

    def marker_path(self, step: int) -> str:
        return f"{self.step_path(step)}/{COMMIT_MARKER}"

    def _invalidate(self, path: str | None = None) -> None:
        try:
            self.fs.invalidate_cache(path)
        except Exception:  # noqa: BLE001 - a cache is only a cache
            pass

    # -- listing -------------------------------------------------------------------------

    @property
    def _flat(self) -> bool:
        """An object store: one listing of the directory names every file of every step (a step is
        a key prefix), where a file system lists a directory's entries only."""
        return self.protocol in OBJECT_STORE_PROTOCOLS

    def step_names(self) -> list[int]:
        """Every integer-named entry under the directory, committed or not."""
        tree = self._step_files()
        if tree is not None:
            return sorted(tree)
        self._invalidate(self.root)
        try:
            entries = self._call("listing checkpoint steps", self.fs.ls, self.root, detail=False)
        except FileNotFoundError:
            return []
        names = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in entries}
        return sorted(int(n) for n in names if n.isdigit())

    def _step_files(self) -> dict[int, list[str]] | None:
        """Object stores: every integer-named step and the paths of its files, from one listing of
        the directory (a LIST request per 1000 files), where a listing of the steps and then a
        request per step for its commit marker would be one round trip per step. None elsewhere,
        or where the listing's paths are not under the directory as this filesystem names it
        (then the steps are listed, and their markers asked, one by one)."""
        if not self._flat:
            return None
        self._invalidate(self.root)
        try:
            paths = self._call("listing checkpoint steps", self.fs.find, self.root, detail=False)
        except FileNotFoundError:
            return {}
        steps: dict[int, list[str]] = {}
        under = self.root + "/"
        for path in map(str, paths):
            path = path if path.startswith(under) else self.fs._strip_protocol(path)
            if not path.startswith(under):
                logger.warning(
                    "listing %s gave %r, not a path under it: listing its steps one by one instead",
                    self.safe_url,
                    scrub(path, self._secrets),
                )
                return None
            rel = path[len(under) :]
            name = rel.split("/", 1)[0]
            if name.isdigit() and "/" in rel:
                steps.setdefault(int(name), []).append(path)
        return steps

    def _committed_in(self, files: list[str]) -> bool:
        return any(
            path.endswith("/" + COMMIT_MARKER) and path.count("/") == self.root.count("/") + 2
            for path in files
        )

    def _read_marker(self, step: int) -> bytes | None:
        """The commit marker of `step` (one GET of the small file), or None when there is none."""
        path = self.marker_path(step)
        self._invalidate(path)
        try:
            return self._call(
                f"reading the commit marker of step {int(step)}",
                self.fs.cat_file,
                path,
                **small_read(self.fs),
            )
        except FileNotFoundError:
            return None

    def read_manifest(self, step: int) -> StepManifest | None:
        """The commit marker's manifest of `step`, or None when the step is not committed."""
        data = self._read_marker(step)
        if data is None:
            return None
        manifest = StepManifest.from_json(data)
        # a marker is written after every file: the step counts, its manifest is lost
        if manifest is None:
            logger.warning(
                "commit marker of step %d in %s is unreadable; listing its files instead",
                step,
                self.safe_url,
            )
            return StepManifest(int(step), {}, [], "", 0.0)
        return manifest

    def read_meta(self, step: int) -> dict:
        """The metadata item of a committed step (`names.STEP_META_FILE`), without downloading the
        step."""
        data = self._call(
            f"reading the metadata of step {int(step)}",
            self.fs.cat_file,
            f"{self.step_path(step)}/{STEP_META_FILE}",
            **small_read(self.fs),
        )
        return json.loads(data)

    def is_committed(self, step: int) -> bool:
        """Whether `step` has its commit marker: one request (a GET of the small marker, where
        asking for its size is a HEAD and, on s3fs, a LIST as well when it is missing)."""
        return self._read_marker(step) is not None

    def committed_steps(self) -> list[int]:
        """Committed steps (those with a commit marker), oldest first."""
        tree = self._step_files()
        if tree is not None:
            return self._committed_of(tree)
        return [s for s in self.step_names() if self.is_committed(s)]

    def _committed_of(self, tree: dict[int, list[str]]) -> list[int]:
        """The committed steps of a `_step_files` listing, oldest first."""
        return sorted(step for step, files in tree.items() if self._committed_in(files))

    def latest_committed(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    # -- retention -------------------------------------------------------------------------

    def delete(self, step: int, files: list[str] | None = None) -> None:
        """Remove one step: its commit marker first (so it stops counting), then its files
        (`files`: all of them, as a listing of this committed step named them; else listed here)."""
        step = int(step)
        marker = self.marker_path(step)
        try:
            self._call(f"removing the commit marker of step {step}", self.fs.rm_file, marker)
        except FileNotFoundError:
            pass
        self._invalidate(marker)
        self._remove_tree(
            step, None if files is None else [f for f in files if f.rstrip("/") != marker]
        )

    def retain(
        self,
        keep: Callable[[list[int]], Collection[int]],
        but: int | None = None,
        deleting: Callable[[int], None] | None = None,
    ) -> list[int]:
        """Delete the committed steps that `keep` (given them all, oldest first) does not name,
        but never `but`; returns the steps deleted, each told to `deleting` before it stops
        counting. On an object store one listing names the steps, their markers and their files
        (then no request per step)."""
        tree = self._step_files()
        steps = self._committed_of(tree) if tree is not None else self.committed_steps()
        kept = set(keep(steps))
        gone = [old for old in steps if old not in kept and old != but]
        for old in gone:
            if deleting is not None:
                deleting(old)
            self.delete(old, tree[old] if tree is not None else None)
        return gone

    def delete_uncommitted(
        self, keep: Callable[[int], bool] = lambda step: False, committed: list[int] | None = None
    ) -> list[int]:
        """Remove integer-named steps without a commit marker (uploads killed part-way), except
        those
        `keep` names (uploads in flight). Only the job's writer may call this. Returns the steps
        removed; `committed`, a list, gets the committed steps it saw (what `committed_steps` would
        list next, but for a step `keep` names that commits meanwhile), oldest first."""
        removed = []
        tree = self._step_files()
        for step in sorted(tree) if tree is not None else self.step_names():
            if self._committed_in(tree[step]) if tree is not None else self.is_committed(step):
                if committed is not None:
                    committed.append(step)
            elif not keep(step):
                logger.warning(
                    "step %d in %s was never committed (an upload stopped part-way): removing it",
                    step,
                    self.safe_url,
                )
                self._remove_tree(step, tree[step] if tree is not None else None)
                removed.append(step)
        return removed
