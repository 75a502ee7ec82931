"""JAX's persistent compilation cache, kept with the job wherever its storage is.

JAX opens its cache directory through its own file layer. Given an object-store URL, that
layer does not get the job's storage options (an S3 endpoint, credentials: a block's): the
cache turns itself off with a warning, and every rerun compiles. On GPUs, JAX also hands XLA
an autotune cache directory under the same URL, which XLA's C++ file system cannot open. And
the path of that autotune directory is part of every cache key JAX computes
(`jax/_src/cache_key.py` does not clear it), so entries written under one local path are
never found under another.

A cache on remote storage is therefore mirrored: JAX uses a local directory with XLA's own
sub-caches off (its keys then name no path), the entries in storage are copied in before
anything compiles, and the entries compiled here are copied back in the background: after
the first step of each interval (the train step's entry, should the node be lost during the
interval), after each interval, evaluation and export, and, waited for, when the job ends or
is preempted. A rerun on another machine loads them. Copying is an optimisation: a failure
is logged and the job compiles instead.

Every entry in storage is copied in: a job's own cache (``"job"``) holds only that job's
compiles; a cache URL shared by many jobs copies theirs too. JAX opens one cache per process:
the first trainer's directory serves the process (as for local directories).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import uuid

import fsspec
import jax
from fsspec.implementations.local import LocalFileSystem

from prefect_jax.training.storage import JobStorage, cache_root, normalize_root

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
    fsspec options for the URL: the job's storage options where the URL is on the storage's
    file system)."""
    url = storage.path("compile-cache") if setting == "job" else normalize_root(setting)
    if "://" in url and _fs_class(url) is LocalFileSystem:  # local://, or a local path the storage spells so
        url = os.path.abspath(url.split("://", 1)[1])
    if "://" not in url:
        return url, None, {}
    if setting == "job":
        return url, storage.staging_dir("compile-cache"), storage.storage_options
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    same = storage.protocol != "file" and _fs_class(url) is _fs_class(storage.root)
    return url, os.path.join(cache_root(), "compile-cache", digest), storage.storage_options if same else {}


def _fs_class(url: str) -> type | str:
    """The fsspec file system class of a URL (its protocol where the class cannot be loaded)."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        return fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return protocol


class CompileCacheMirror:
    """A local copy of a remote compilation cache: `pull` copies the entries in storage that are
    not here; `push_async` copies back, on one background thread, the entries made here that
    are not in storage. Entries are named by their key, so names are compared, never contents.

    JAX writes an entry in place (`jax/_src/lru_cache.py`), so a copy taken while it writes
    would be partial: `push_async` lists the entries on the caller's thread, at a point where
    nothing compiles (the caller says so), and an entry whose size or modification time changed
    by the end of its upload is not counted as stored (the next push copies it again). On
    object stores each copy is one PUT: a reader never sees part of one.

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
        self._stored: set[str] = set()  # names known to be in storage
        self._pending: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) when listed
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        options = dict(self.storage_options)
        options.setdefault("use_listings_cache", False)
        return fsspec.core.url_to_fs(self.url, **options)[0]

    def _local_entries(self) -> dict[str, tuple[int, int]]:
        entries = {}
        try:
            names = [n for n in os.listdir(self.local_dir) if n.endswith(ENTRY_SUFFIX)]
        except FileNotFoundError:
            return entries
        for name in names:
            try:
                st = os.stat(os.path.join(self.local_dir, name))
            except FileNotFoundError:
                continue
            entries[name] = (st.st_size, st.st_mtime_ns)
        return entries

    # -- pull --------------------------------------------------------------------------------

    def pull(self, timeout: float = 120.0) -> list[str]:
        """Copy the entries in storage that are not here, waiting up to `timeout` seconds (a copy
        still under way then goes on in the background; JAX compiles what is not here yet).
        The names copied; none on a failure (logged)."""
        os.makedirs(self.local_dir, exist_ok=True)
        done: list[list[str]] = []
        worker = threading.Thread(target=lambda: done.append(self._pull()), name="prefect-jax-compile-cache", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            logger.warning("compilation cache %s: still copying after %.0fs; compiling what is not here yet", self.url, timeout)
            return []
        return done[0] if done else []

    def _pull(self) -> list[str]:
        temps: list[str] = []
        try:
            fs = self.fs
            try:
                listed = fs.ls(self.url, detail=False)
            except FileNotFoundError:
                listed = []
            stored = {n for n in (p.rstrip("/").rsplit("/", 1)[-1] for p in listed) if n.endswith(ENTRY_SUFFIX)}
            missing = sorted(stored - set(self._local_entries()))
            temps = [os.path.join(self.local_dir, f".{name}.tmp-{uuid.uuid4().hex}") for name in missing]
            if missing:
                fs.get([f"{self.url}/{name}" for name in missing], temps)  # concurrent where the file system is async
            for name, temp in zip(missing, temps):
                os.replace(temp, os.path.join(self.local_dir, name))  # whole, or not there
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be read: compile instead
            for temp in temps:
                try:
                    os.remove(temp)
                except OSError:
                    pass
            logger.warning("compilation cache %s could not be read (%s: %s): compiling what it lacks", self.url, type(exc).__name__, exc)
            return []
        with self._lock:
            self._stored |= stored
            self.pulled += missing
        if missing:
            logger.info("compilation cache: %d entries copied from %s to %s", len(missing), self.url, self.local_dir)
        return missing

    # -- push --------------------------------------------------------------------------------

    def push_async(self) -> None:
        """List the entries made here that are not in storage and copy them on the background
        thread. Call it where nothing compiles (after a step, an evaluation, an export)."""
        if not self.can_push:
            return
        with self._lock:
            new = {n: stat for n, stat in self._local_entries().items() if n not in self._stored}
            if not new:
                return
            self._pending.update(new)
            if self._thread is None:
                self._thread = threading.Thread(target=self._push_pending, name="prefect-jax-compile-cache", daemon=True)
                self._thread.start()

    def _push_pending(self) -> None:
        """The background thread: copy what is pending until nothing is."""
        while True:
            with self._lock:
                batch, self._pending = self._pending, {}
                if not batch:
                    self._thread = None
                    return
            names = sorted(batch)
            try:
                local = [os.path.join(self.local_dir, n) for n in names]
                self.fs.put(local, [f"{self.url}/{n}" for n in names])  # concurrent where the file system is async
            except Exception as exc:  # noqa: BLE001 - the next push tries again
                logger.warning("compilation cache: could not copy entries to %s (%s: %s)", self.url, type(exc).__name__, exc)
                continue
            now = self._local_entries()
            whole = [n for n in names if now.get(n) == batch[n]]  # unchanged while it was copied
            with self._lock:
                self._stored.update(whole)
                self.pushed += whole

    def flush(self, timeout: float = 30.0) -> bool:
        """`push_async`, then wait up to `timeout` seconds for the copies; True if none is left
        under way (a process may end without the rest: a rerun elsewhere compiles it again)."""
        self.push_async()
        with self._lock:
            running = self._thread
        if running is not None:
            running.join(max(0.0, timeout))
        return running is None or not running.is_alive()
