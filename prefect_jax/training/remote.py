"""Checkpoint steps on any fsspec URL: upload with a commit marker written last, download to a cache.

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
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

import fsspec

from prefect_jax.training.names import COMMIT_MARKER, STEP_META_FILE
from prefect_jax.training.redaction import redact_options, redact_url, scrub, secret_values
from prefect_jax.training.storage import atomic_write, small_read

__all__ = [
    "RemoteConfigError", "RemoteStorageError", "RemoteSteps", "RemoteUnreachableError",
    "StepManifest", "first_line", "is_transient",
]  # fmt: skip

logger = logging.getLogger("prefect_jax.remote")

MARKER_FORMAT = 1

# Protocols fsspec resolves to the local disk: markers are written with a rename there.
LOCAL_PROTOCOLS = ("file", "local")
# Object stores: no directories to create (so no bucket is created by accident), and their fsspec
# implementations cache listings, which must see steps other processes commit.
_OBJECT_STORE_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2")


# -- errors -----------------------------------------------------------------------------


class RemoteStorageError(Exception):
    """A remote checkpoint directory cannot be used; the message names the (redacted) URL and what to check."""

    def __init__(self, message: str, url: str = ""):
        super().__init__(message)
        self.url = url  # already redacted


class RemoteConfigError(RemoteStorageError, ValueError):
    """Unknown protocol, missing package, missing or refused credentials, bad options: a retry cannot fix it."""


class RemoteUnreachableError(RemoteStorageError, ConnectionError):
    """The storage service did not answer (endpoint down, network, timeout): a retry may fix it."""


_CREDENTIAL_ERRORS = {
    "NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "UnknownCredentialError",
    "NoAuthTokenError", "ProfileNotFound", "DefaultCredentialsError", "RefreshError",
    "ClientAuthenticationError", "CredentialUnavailableError", "InvalidConfigError",
}
_UNREACHABLE_ERRORS = {
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "ProxyConnectionError", "HTTPClientError", "ClientConnectorError", "ClientConnectionError",
    "ClientOSError", "ServerDisconnectedError", "ServerTimeoutError", "FSTimeoutError",
    "ServiceRequestError", "ServiceResponseError", "TransportError", "ConnectionError", "TimeoutError",
}


def _class_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _is_credentials_error(exc: BaseException) -> bool:
    return bool(_class_names(exc) & _CREDENTIAL_ERRORS)


def _is_unreachable_error(exc: BaseException) -> bool:
    if isinstance(exc, RemoteUnreachableError):
        return True
    if isinstance(exc, (ConnectionError, TimeoutError, socket.timeout, socket.gaierror)):
        return True
    return bool(_class_names(exc) & _UNREACHABLE_ERRORS)


def is_transient(exc: BaseException) -> bool:
    """True when retrying the same transfer may succeed: I/O errors, timeouts, an endpoint that did
    not answer. False for configuration errors, refused credentials, and files that are not there."""
    if isinstance(exc, RemoteConfigError):
        return False
    if _is_unreachable_error(exc):
        return True
    if isinstance(exc, (PermissionError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)):
        return False
    return isinstance(exc, OSError)


_CREDENTIAL_HINTS = {
    "s3": "pass key/secret (and token) in the storage options, set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
    "AWS_PROFILE, or anon=True for a public bucket",
    "gs": "pass token= (a service-account JSON file) in the storage options, or set GOOGLE_APPLICATION_CREDENTIALS",
    "az": "pass account_name with account_key, sas_token or connection_string in the storage options, or set "
    "AZURE_STORAGE_CONNECTION_STRING",
}
_CREDENTIAL_HINTS.update(s3a=_CREDENTIAL_HINTS["s3"], gcs=_CREDENTIAL_HINTS["gs"], abfs=_CREDENTIAL_HINTS["az"],
                         abfss=_CREDENTIAL_HINTS["az"])


def first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


# -- the remote directory ---------------------------------------------------------------


def _protocol_of(url: str) -> str:
    last = url.split("::")[0]
    return last.split("://", 1)[0] if "://" in last else "file"


def _local_tree(local_dir: str) -> tuple[list[str], dict[str, int]]:
    """(sub-directories, {file: size}) under `local_dir`, as sorted ``/``-separated relative paths."""
    dirs: list[str] = []
    files: dict[str, int] = {}
    for here, subdirs, names in os.walk(local_dir):
        subdirs.sort()
        rel_here = os.path.relpath(here, local_dir)
        prefix = "" if rel_here == "." else rel_here.replace(os.sep, "/") + "/"
        for d in subdirs:
            dirs.append(prefix + d)
        for name in sorted(names):
            if not prefix and name == COMMIT_MARKER:
                continue  # a downloaded copy's marker; a fresh one is written
            files[prefix + name] = os.path.getsize(os.path.join(here, name))
    return dirs, files


@dataclass(frozen=True)
class StepManifest:
    """What the commit marker of one step records."""

    step: int
    files: dict[str, int]
    dirs: list[str]
    upload_id: str
    uploaded_at: float

    def to_json(self) -> bytes:
        return json.dumps(
            {"format": MARKER_FORMAT, "step": self.step, "files": self.files, "dirs": self.dirs,
             "upload_id": self.upload_id, "uploaded_at": self.uploaded_at, "host": socket.gethostname(),
             "pid": os.getpid()},
            indent=1, sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | str, step: int) -> "StepManifest | None":
        try:
            obj = json.loads(data)
            return cls(int(obj["step"]), {str(k): int(v) for k, v in obj["files"].items()},
                       [str(d) for d in obj.get("dirs", [])], str(obj["upload_id"]), float(obj.get("uploaded_at", 0)))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


class RemoteSteps:
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
            raise RemoteConfigError(f"remote checkpoint URL {url!r} is empty: give a URL such as s3://bucket/prefix")
        url = url.strip()
        if "://" not in url:
            url = os.path.abspath(os.path.expanduser(url))
        self.url = url.rstrip("/") or url
        self.protocol = _protocol_of(self.url)
        self.safe_url = redact_url(self.url)
        self._options = dict(storage_options or {})
        self._secrets = secret_values(self.url, self._options)
        options = dict(self._options)
        if self.protocol in _OBJECT_STORE_PROTOCOLS:
            options.setdefault("use_listings_cache", False)  # see steps committed by other processes
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        except Exception as exc:  # noqa: BLE001 - every construction failure becomes a clear error
            raise self._config_error(exc) from None
        self.root = self.root.rstrip("/")

    def __repr__(self) -> str:
        return f"RemoteSteps({self.safe_url!r})"

    # -- errors --------------------------------------------------------------------------

    @property
    def storage_options(self) -> dict:
        """The storage options, redacted (for logs and messages)."""
        return redact_options(self._options)

    def _endpoint(self) -> str | None:
        for holder in (self._options, self._options.get("client_kwargs") or {}):
            for name in ("endpoint_url", "endpoint", "host"):
                if isinstance(holder, Mapping) and holder.get(name):
                    return redact_url(str(holder[name]))
        return None

    def _cause(self, exc: BaseException) -> str:
        return scrub(f"{type(exc).__name__}: {first_line(str(exc))}", self._secrets)

    def _config_error(self, exc: BaseException) -> RemoteConfigError:
        if isinstance(exc, ValueError) and "protocol not known" in str(exc).lower():
            known = ", ".join(p for p in ("file", "memory", "s3", "gs", "az", "abfs", "http", "sftp", "hdfs")
                              if p in fsspec.available_protocols())
            return RemoteConfigError(
                f"remote checkpoint URL {self.safe_url}: fsspec knows no protocol {self.protocol!r}. Check the "
                f"spelling of the URL's scheme (known ones include {known}), or install the package that "
                "implements it.", self.safe_url)
        if isinstance(exc, ImportError):
            return RemoteConfigError(
                f"remote checkpoint URL {self.safe_url}: protocol {self.protocol!r} needs a package that is not "
                f"installed ({self._cause(exc)}). Install it in this environment (s3fs for s3://, gcsfs for "
                "gs://, adlfs for az://).", self.safe_url)
        return RemoteConfigError(
            f"remote checkpoint URL {self.safe_url}: cannot open {self.protocol}:// with the given storage options "
            f"({self._cause(exc)}). Check the storage options (redacted: {self.storage_options}).", self.safe_url)

    def _translate(self, exc: BaseException, doing: str) -> BaseException | None:
        """A clear error for a failure of `doing`, or None to let `exc` through unchanged."""
        where = self.safe_url + (f" (endpoint {self._endpoint()})" if self._endpoint() else "")
        if isinstance(exc, RemoteStorageError):
            return None
        if _is_credentials_error(exc):
            hint = _CREDENTIAL_HINTS.get(self.protocol, "pass the credentials in the storage options")
            return RemoteConfigError(
                f"no usable credentials for {where} while {doing} ({self._cause(exc)}): {hint}.", self.safe_url)
        if isinstance(exc, PermissionError):
            return RemoteConfigError(
                f"access to {where} was refused while {doing} ({self._cause(exc)}): check that the credentials "
                "are right and allowed to list, read, write and delete under this prefix.", self.safe_url)
        if _is_unreachable_error(exc):
            return RemoteUnreachableError(
                f"cannot reach {where} while {doing} ({self._cause(exc)}): check the endpoint URL, the network "
                "and that the storage service is up; this is retried as a transient error.", self.safe_url)
        if isinstance(exc, TypeError) and "keyword argument" in str(exc):
            return self._config_error(exc)
        if isinstance(exc, ImportError):
            return self._config_error(exc)
        return None

    def _call(self, doing: str, fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - translated or re-raised as is
            clear = self._translate(exc, doing)
            if clear is None:
                raise
            raise clear from None

    # -- paths ---------------------------------------------------------------------------

    def step_path(self, step: int) -> str:
        return f"{self.root}/{int(step)}"

    def marker_path(self, step: int) -> str:
        return f"{self.step_path(step)}/{COMMIT_MARKER}"

    def step_url(self, step: int) -> str:
        """The (unredacted) URL of one step directory."""
        return f"{self.url}/{int(step)}"

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
        return self.protocol in _OBJECT_STORE_PROTOCOLS

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
                logger.warning("listing %s gave %r, not a path under it: listing its steps one by one instead",
                               self.safe_url, scrub(path, self._secrets))  # fmt: skip
                return None
            rel = path[len(under):]
            name = rel.split("/", 1)[0]
            if name.isdigit() and "/" in rel:
                steps.setdefault(int(name), []).append(path)
        return steps

    def _committed_in(self, files: list[str]) -> bool:
        return any(path.endswith("/" + COMMIT_MARKER) and path.count("/") == self.root.count("/") + 2 for path in files)

    def _read_marker(self, step: int) -> bytes | None:
        """The commit marker of `step` (one GET of the small file), or None when there is none."""
        path = self.marker_path(step)
        self._invalidate(path)
        try:
            return self._call(f"reading the commit marker of step {int(step)}", self.fs.cat_file, path, **small_read(self.fs))
        except FileNotFoundError:
            return None

    def read_manifest(self, step: int) -> StepManifest | None:
        """The commit marker's manifest of `step`, or None when the step is not committed."""
        data = self._read_marker(step)
        if data is None:
            return None
        manifest = StepManifest.from_json(data, int(step))
        if manifest is None:  # a marker is written after every file: the step counts, its manifest is lost
            logger.warning("commit marker of step %d in %s is unreadable; listing its files instead", step, self.safe_url)
            return StepManifest(int(step), {}, [], "", 0.0)
        return manifest

    def read_meta(self, step: int) -> dict:
        """The metadata item of a committed step (`names.STEP_META_FILE`), without downloading the step."""
        data = self._call(f"reading the metadata of step {int(step)}", self.fs.cat_file, f"{self.step_path(step)}/{STEP_META_FILE}",
                          **small_read(self.fs))  # fmt: skip
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

    # -- upload ----------------------------------------------------------------------------

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
            raise FileNotFoundError(f"local checkpoint step {local} is not a directory: nothing to upload as step {step}")
        if self.is_committed(step):
            if not overwrite:
                logger.info("step %d is already committed in %s; not uploading it again", step, self.safe_url)
                return False
            self._call(f"removing the commit marker of step {step}", self.fs.rm_file, self.marker_path(step))
        dirs, files = _local_tree(local)
        manifest = StepManifest(step, files, dirs, uuid.uuid4().hex, time.time())
        started = time.monotonic()
        if not self._flat:
            self._remove_tree(step)  # an earlier, uncommitted upload (object stores: after the copy, below)
        target = self.step_path(step)
        lpaths = [os.path.join(local, *f.split("/")) for f in files]
        rpaths = [f"{target}/{f}" for f in files]
        if self.protocol not in _OBJECT_STORE_PROTOCOLS:  # directories first, parents before children
            lpaths = [local] + [os.path.join(local, *d.split("/")) for d in dirs] + lpaths
            rpaths = [target] + [f"{target}/{d}" for d in dirs] + rpaths
        try:
            self._call(f"uploading step {step} from {local}", self.fs.put, lpaths, rpaths)
        except FileNotFoundError as exc:
            if not os.path.isdir(local):
                raise FileNotFoundError(
                    f"local checkpoint step {local} disappeared while it was uploaded as step {step} (was it "
                    "removed by local retention before its upload finished?); the step is not committed") from exc
            raise RemoteConfigError(
                f"cannot write step {step} under {self.safe_url} ({self._cause(exc)}): check that the bucket or "
                "container exists and the URL is spelled right.", self.safe_url) from None
        self._verify_remote(step, manifest)
        self._write_marker(step, manifest)
        size = sum(files.values())
        logger.info("uploaded step %d (%d files, %.1f MiB) to %s in %.1fs",
                    step, len(files), size / 2**20, self.safe_url, time.monotonic() - started)
        return True

    def _remove_tree(self, step: int, files: list[str] | None = None) -> None:
        """Remove a step's files: `files` where a listing named them all (object stores: removed
        in bulk without listing them again; none, nothing to do), else the step's directory."""
        path = self.step_path(step)
        self._invalidate(path)
        if files is not None and any(f.endswith("/") for f in files):
            files = None  # a "directory" key (some tools write them) is removed only by removing the tree
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
            rel = name[len(path) + 1:] if name.startswith(path + "/") else name.rsplit("/", 1)[-1]
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
                f"upload of step {step} to {self.safe_url} is incomplete after copying: {len(bad)} file(s) missing "
                f"or of the wrong size (first: {bad[0]}); it is not committed and will be uploaded again")

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

        The files land in a temporary sibling (``.<step>.download-*``, which Orbax does not take
        for a step) and are renamed into place once all are there with the sizes the marker
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
                f"step {step} is not committed in {self.safe_url} (committed steps: {self.committed_steps()}); "
                "a step counts once its upload wrote the commit marker")
        local_dir = os.path.abspath(local_dir)
        os.makedirs(local_dir, exist_ok=True)
        target = os.path.join(local_dir, str(step))
        if manifest.upload_id and _local_copy_matches(target, manifest):
            return target
        files = manifest.files or self._remote_sizes(step)
        dirs = manifest.dirs
        tmp = os.path.join(local_dir, f".{step}.download-{uuid.uuid4().hex[:12]}")
        started = time.monotonic()
        try:
            os.makedirs(tmp)
            for d in dirs:
                os.makedirs(os.path.join(tmp, *d.split("/")), exist_ok=True)
            for f in files:
                os.makedirs(os.path.dirname(os.path.join(tmp, *f.split("/"))), exist_ok=True)
            rpaths = [f"{self.step_path(step)}/{f}" for f in files]
            lpaths = [os.path.join(tmp, *f.split("/")) for f in files]
            if rpaths:
                self._call(f"downloading step {step}", self.fs.get, rpaths, lpaths)
            wrong = [f for f, size in files.items() if os.path.getsize(os.path.join(tmp, *f.split("/"))) != size]
            if wrong:
                raise OSError(f"download of step {step} from {self.safe_url}: {len(wrong)} file(s) came down with the "
                              f"wrong size (first: {wrong[0]}); retry the download")
            with open(os.path.join(tmp, COMMIT_MARKER), "wb") as f:
                f.write(manifest.to_json())
            if os.path.lexists(target):
                _move_aside_and_remove(target)
            try:
                os.rename(tmp, target)
            except OSError:
                if _local_copy_matches(target, manifest):  # another process put the same copy there first
                    shutil.rmtree(tmp, ignore_errors=True)
                    return target
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("downloaded step %d (%d files, %.1f MiB) from %s to %s in %.1fs", step, len(files),
                    sum(files.values()) / 2**20, self.safe_url, target, time.monotonic() - started)
        return target

    def download_latest(self, local_dir: str) -> tuple[int, str] | None:
        """Download the newest committed step: ``(step, local path)``, or None when nothing is committed."""
        step = self.latest_committed()
        return None if step is None else (step, self.download(step, local_dir))

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
        self._remove_tree(step, None if files is None else [f for f in files if f.rstrip("/") != marker])

    def retain(self, keep: Callable[[list[int]], Collection[int]], but: int | None = None,
               deleting: Callable[[int], None] | None = None) -> list[int]:  # fmt: skip
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

    def delete_uncommitted(self, keep: Callable[[int], bool] = lambda step: False, committed: list[int] | None = None) -> list[int]:
        """Remove integer-named steps without a commit marker (uploads killed part-way), except those
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
                logger.warning("step %d in %s was never committed (an upload stopped part-way): removing it",
                               step, self.safe_url)
                self._remove_tree(step, tree[step] if tree is not None else None)
                removed.append(step)
        return removed


def _local_copy_matches(path: str, manifest: StepManifest) -> bool:
    """A local step directory is a complete copy of the upload `manifest` describes."""
    try:
        with open(os.path.join(path, COMMIT_MARKER), "rb") as f:
            local = StepManifest.from_json(f.read(), manifest.step)
    except OSError:
        return False
    if local is None or local.upload_id != manifest.upload_id:
        return False
    try:
        return all(os.path.getsize(os.path.join(path, *f.split("/"))) == size for f, size in manifest.files.items())
    except OSError:
        return False


def _move_aside_and_remove(path: str) -> None:
    aside = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.stale-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)
