"""JAX's persistent compilation cache, kept with the job wherever its storage is.

JAX opens its cache directory through its own file layer. Given an object-store URL, that
layer does not get the job's storage options (an S3 endpoint, credentials): the cache turns
itself off with a warning, and every rerun compiles. On GPUs, JAX also hands XLA an autotune
cache directory under the same URL, which XLA's C++ file system cannot open. And the path of
that autotune directory is part of every cache key JAX computes (`jax/_src/cache_key.py` does
not clear it), so entries written under one local path are never found under another.

A cache on remote storage is therefore mirrored: JAX uses a local directory with XLA's own
sub-caches off (its keys then name no path), the entries in storage are copied in before
anything compiles, and the entries compiled here are copied back in the background after each
checkpoint interval and when the trainer closes. A rerun on another machine loads them.
Copying is an optimisation: a failure is logged and the job compiles instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid

import fsspec
import jax

from prefect_jax.training.storage import JobStorage, cache_root

logger = logging.getLogger("prefect_jax.compile_cache")

ENTRY_SUFFIX = "-cache"  # JAX's entry files (jax/_src/lru_cache.py); its "-atime" files are local bookkeeping


def enable_compilation_cache(directory: str, xla_caches: bool = True) -> None:
    """Turn on JAX's persistent compilation cache in `directory` (every compile is cached).

    ``xla_caches=False`` turns off the XLA caches JAX derives from the directory (GPU autotune
    results), unless ``JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES`` says otherwise: their path is
    part of the cache key."""
    if "://" not in directory:
        os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if not xla_caches and "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES" not in os.environ:
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")


def open_compilation_cache(setting: str, storage: JobStorage, push: bool = True) -> CompileCacheMirror | None:
    """Turn on JAX's persistent compilation cache for a job: `setting` is ``"job"`` (under the
    job's storage) or a directory or URL. Local directories are used as they are; a URL is
    mirrored (see the module docstring) and the mirror returned, its entries already pulled.
    ``push=False``: this process only reads the cache (with several JAX processes, process 0
    writes it, as JAX does)."""
    url, local, options = locate(setting, storage)
    if local is None:
        enable_compilation_cache(url)
        return None
    mirror = CompileCacheMirror(url, local, options, push=push)
    mirror.pull()
    enable_compilation_cache(local, xla_caches=False)
    return mirror


def locate(setting: str, storage: JobStorage) -> tuple[str, str | None, dict]:
    """Where a job's cache is: (its directory or URL, the local mirror of a URL or None, the
    fsspec options for the URL: the job's storage options where the protocol is the storage's)."""
    url = storage.path("compile-cache") if setting == "job" else setting.rstrip("/")
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" not in url:
        return os.path.abspath(os.path.expanduser(url)), None, {}
    if setting == "job":
        return url, storage.staging_dir("compile-cache"), storage.storage_options
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    same = url.split("://", 1)[0] == storage.protocol
    return url, os.path.join(cache_root(), "compile-cache", digest), storage.storage_options if same else {}


class CompileCacheMirror:
    """A local copy of a remote compilation cache: `pull` copies the entries in storage that are
    not here, `push` (or `push_async`, on a background thread) the entries made here that are
    not in storage. Entries are immutable (named by their key), so names are compared, never
    contents; a local entry appears whole (written beside it, then renamed).

    Args:
        url: the cache in storage (any fsspec URL).
        local_dir: the directory JAX reads and writes.
        storage_options: fsspec options for `url`'s file system.
        push: whether this process copies entries back (False: read only).
    """

    def __init__(self, url: str, local_dir: str, storage_options: dict | None = None, push: bool = True):
        self.url = url.rstrip("/")
        self.local_dir = local_dir
        self.storage_options = dict(storage_options or {})
        self.can_push = push
        self.pulled: list[str] = []
        self.pushed: list[str] = []
        self._in_storage: set[str] = set()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        options = dict(self.storage_options)
        options.setdefault("use_listings_cache", False)
        return fsspec.core.url_to_fs(self.url, **options)[0]

    def _local_entries(self) -> set[str]:
        try:
            return {n for n in os.listdir(self.local_dir) if n.endswith(ENTRY_SUFFIX)}
        except FileNotFoundError:
            return set()

    def _stored_entries(self, fs) -> set[str]:
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(self.url, detail=False)]
        except FileNotFoundError:
            return set()
        return {n for n in names if n.endswith(ENTRY_SUFFIX)}

    def pull(self) -> list[str]:
        """Copy the entries in storage that are not here; the names copied (none on a failure, logged)."""
        os.makedirs(self.local_dir, exist_ok=True)
        try:
            fs = self.fs
            stored = self._stored_entries(fs)
            missing = sorted(stored - self._local_entries())
            temps = [os.path.join(self.local_dir, f".{name}.tmp-{uuid.uuid4().hex}") for name in missing]
            if missing:
                fs.get([f"{self.url}/{name}" for name in missing], temps)  # concurrent where the file system is async
            for name, temp in zip(missing, temps):
                os.replace(temp, os.path.join(self.local_dir, name))
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be read: compile instead
            logger.warning("compilation cache %s could not be read (%s: %s): compiling what it lacks", self.url, type(exc).__name__, exc)
            return []
        with self._lock:
            self._in_storage |= stored
            self.pulled += missing
        if missing:
            logger.info("compilation cache: %d entries copied from %s to %s", len(missing), self.url, self.local_dir)
        return missing

    def push(self) -> list[str]:
        """Copy the entries made here that are not in storage; the names copied (a failure is logged)."""
        if not self.can_push:
            return []
        with self._lock:
            new = sorted(self._local_entries() - self._in_storage)
        copied = []
        try:
            if new:
                fs = self.fs
                for name in new:  # one PUT each: a reader never sees part of an entry
                    fs.put_file(os.path.join(self.local_dir, name), f"{self.url}/{name}")
                    copied.append(name)
        except Exception as exc:  # noqa: BLE001 - the next push tries again
            logger.warning("compilation cache: could not copy entries to %s (%s: %s)", self.url, type(exc).__name__, exc)
        with self._lock:
            self._in_storage.update(copied)
            self.pushed += copied
        return copied

    def push_async(self) -> None:
        """`push` on a background thread (at most one at a time: a push under way is not doubled)."""
        if not self.can_push:
            return
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            if not (self._local_entries() - self._in_storage):
                return
            self._thread = threading.Thread(target=self.push, name="prefect-jax-compile-cache", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Push what is left, waiting up to `timeout` seconds in all (then the process may go on
        without it: what was not copied is compiled again by a rerun elsewhere)."""
        if not self.can_push:
            return
        deadline = time.monotonic() + timeout
        with self._lock:
            running = self._thread
        if running is not None:
            running.join(max(0.0, deadline - time.monotonic()))
        worker = threading.Thread(target=self.push, name="prefect-jax-compile-cache", daemon=True)
        worker.start()
        worker.join(max(0.0, deadline - time.monotonic()))
