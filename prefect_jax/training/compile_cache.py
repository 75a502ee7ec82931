"""JAX's persistent compilation cache, kept with the job wherever its storage is.

JAX opens its cache directory through its own file layer. Given an object-store URL, that
layer does not get the job's storage options (an S3 endpoint, credentials: a block's): the
cache turns itself off with a warning, and every rerun compiles. On GPUs, JAX also hands XLA
an autotune cache directory under the same URL, which XLA's C++ file system cannot open. And
the path of that autotune directory is part of every cache key JAX computes
(`jax/_src/cache_key.py` does not clear it), so entries written under one local path are
never found under another. A local directory keeps them on a GPU (autotune results are worth
the path in the key) and turns them off elsewhere (they hold nothing there).

A cache on remote storage is therefore mirrored: JAX uses a local directory with XLA's own
sub-caches off (its keys then name no path), the entries in storage are copied in while the
job sets up and restores (the trainer waits for them before it compiles its steps), and the
entries compiled here are copied back in the background: after the first step of each interval
(the train step's entry, should the node be lost during the interval; with several JAX
processes, at the interval's first log point), after each checkpoint, evaluation and export;
and, waited for, on SIGTERM (within its grace, at most 10 s), when a training job ends (at
most 30 s) and when the process exits (the evaluate and export flows). A rerun on another
machine loads them. Copying is an optimisation: a failure is logged and the job compiles
instead. The copying is `prefect_jax.training.compile_cache_mirror`'s.

Every entry in storage is copied in: a job's own cache (``"job"``) holds only that job's
compiles; a cache URL shared by many jobs copies theirs too. JAX opens one cache per process:
a trainer that asks for another one while JAX has one open gets none (a warning says so).
"""

from __future__ import annotations

import hashlib
import logging
import os

import fsspec
import jax
from fsspec.implementations.local import LocalFileSystem
from jax._src import compilation_cache as _jax_cache

from prefect_jax.training.compile_cache_mirror import CompileCacheMirror
from prefect_jax.training.redaction import redact_url
from prefect_jax.training.storage import JobStorage, cache_root, normalize_root

logger = logging.getLogger("prefect_jax.compile_cache")


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


def open_compilation_cache(
    setting: str, storage: JobStorage, push: bool = True
) -> CompileCacheMirror | None:
    """Turn on JAX's persistent compilation cache for a job: `setting` is ``"job"`` (under the
    job's storage) or a directory or URL. Local directories are used as they are; a URL is
    mirrored (see the module docstring) and the mirror returned, its entries being pulled in
    the background: call its `wait_pulled` before compiling the job's steps.
    ``push=False``: this process only reads the cache (with several JAX processes, process 0
    writes it, as JAX does). Where JAX has another cache open in this process already, nothing
    is turned on (a warning says so): JAX opens one per process."""
    url, local, options = locate(setting, storage)
    directory = url if local is None else local
    current = open_jax_cache_dir()
    if current is not None and os.path.abspath(current) != os.path.abspath(directory):
        logger.warning(
            "JAX's compilation cache in this process is %s already (JAX opens one per process): "
            "%s is not used; run the job in a process of its own to use it",
            current,
            redact_url(url),
        )
        return None
    if local is None:
        # XLA's caches under it (autotune results) serve GPUs only, and their path is in every
        # key: elsewhere they are off, so the entries are found wherever the job is mounted
        enable_compilation_cache(url, xla_caches=jax.default_backend() == "gpu")
        return None
    mirror = CompileCacheMirror(url, local, options, push=push)
    mirror.start_pull()
    enable_compilation_cache(local, xla_caches=False)
    return mirror


def open_jax_cache_dir() -> str | None:
    """The directory of the compilation cache JAX has open in this process (None: none yet)."""
    path = getattr(_jax_cache._cache, "_path", None) if _jax_cache._cache_initialized else None
    return None if path is None else str(path)


def locate(setting: str, storage: JobStorage) -> tuple[str, str | None, dict]:
    """Where a job's cache is: (its directory or URL, the local mirror of a URL or None, the
    fsspec options for the URL: the job's storage options where the URL is on the storage's
    file system)."""
    url = storage.path("compile-cache") if setting == "job" else normalize_root(setting)
    if (
        "://" in url and _fs_class(url) is LocalFileSystem
    ):  # local://, or a local path the storage spells so
        url = os.path.abspath(url.split("://", 1)[1])
    if "://" not in url:
        return url, None, {}
    if setting == "job":
        return url, storage.staging_dir("compile-cache"), storage.storage_options
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    same = storage.protocol != "file" and _fs_class(url) == _fs_class(storage.root)
    return (
        url,
        os.path.join(cache_root(), "compile-cache", digest),
        storage.storage_options if same else {},
    )


def _fs_class(url: str) -> type | str:
    """The fsspec file system class of a URL (its protocol where the class cannot be loaded)."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        return fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return protocol
