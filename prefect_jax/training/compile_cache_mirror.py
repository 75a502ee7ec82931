"""The local mirror of a compilation cache on remote storage: JAX reads and writes a local
directory, and `CompileCacheMirror` copies entries between it and storage (why and when:
`prefect_jax.training.compile_cache`).

Only whole entries are copied, either way: JAX writes an entry in place, and compresses every
entry (`jax/_src/compilation_cache.py`), so an entry that does not decompress is still being
written, or was cut short; it is left where it is. One found in storage is compiled here and
copied over it.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import uuid
import weakref

import fsspec
from jax._src import compilation_cache as _jax_cache

from prefect_jax.training.redaction import redact_url, scrub, secret_values

# The set-up's logger too (`compile_cache`): one name for the cache's messages.
logger = logging.getLogger("prefect_jax.compile_cache")

ENTRY_SUFFIX = "-cache"  # JAX's entry files (jax/_src/lru_cache.py)
ATIME_SUFFIX = "-atime"  # its last-use files: read by its eviction (jax_compilation_cache_max_size)
PUSH_BATCH_BYTES = 64 << 20  # entries read into memory per upload batch
END_FLUSH_SECS = 30.0  # how long a training job's end, and the process's exit, wait for copies
SIGTERM_FLUSH_SECS = 10.0  # at most, of a SIGTERM's grace left once its step committed


def is_whole_entry(data: bytes) -> bool:
    """Whether `data` is a whole JAX cache entry: JAX compresses every entry, and a compressed
    stream cut short does not decompress."""
    if not data:
        return False
    try:
        _jax_cache.decompress_executable(data)
    except Exception:  # noqa: BLE001 - zlib.error, zstd's errors: not a whole entry
        return False
    return True


def local_entries(directory: str) -> dict[str, tuple[int, int]]:
    """The JAX cache entries in `directory`, by name: their (size, mtime_ns)."""
    entries = {}
    try:
        names = [n for n in os.listdir(directory) if n.endswith(ENTRY_SUFFIX)]
    except FileNotFoundError:
        return entries
    for name in names:
        try:
            st = os.stat(os.path.join(directory, name))
        except FileNotFoundError:
            continue
        entries[name] = (st.st_size, st.st_mtime_ns)
    return entries


def install_entry(directory: str, name: str, temp: str) -> None:
    """Move the whole entry copied to `temp` into `directory` as `name` (whole, or not there),
    with a last-use file stamped now, as JAX's put does: its eviction reads it."""
    os.replace(temp, os.path.join(directory, name))
    stamp = time.time_ns().to_bytes(8, "little")
    with open(os.path.join(directory, name[: -len(ENTRY_SUFFIX)] + ATIME_SUFFIX), "wb") as f:
        f.write(stamp)


class CompileCacheMirror:
    """A local copy of a remote compilation cache: `pull` copies the whole entries in storage
    that are not here; `push_async` copies back, on one background thread, the whole entries made
    here that are not in storage. Entries are named by their key, so names are compared; contents
    are only checked to be whole.

    A SIGTERM handler may call `flush` on the main thread while that thread is inside
    `push_async`: the lock is reentrant and held only around bookkeeping.

    Args:
        url: the cache in storage (any fsspec URL).
        local_dir: the directory JAX reads and writes.
        storage_options: fsspec options for `url`'s file system.
        push: whether this process copies entries back (False: read only).
    """

    def __init__(
        self, url: str, local_dir: str, storage_options: dict | None = None, push: bool = True
    ):
        self.url = url.rstrip("/")
        self.local_dir = local_dir
        self.storage_options = dict(storage_options or {})
        self.can_push = push
        self.pulled: list[str] = []
        self.pushed: list[str] = []
        self._stored: set[str] = set()  # names known to be whole in storage
        # Local entries found not whole: their (size, mtime_ns) then.
        self._partial: dict[str, tuple[int, int]] = {}
        self._pending: set[str] = set()
        self._copying: set[str] = set()  # taken by the background thread, not stored yet
        self._thread: threading.Thread | None = None
        self._lock = threading.RLock()
        self._fs: fsspec.AbstractFileSystem | None = None
        self._puller: threading.Thread | None = None
        self._pull_deadline = 0.0
        self._pull_result: list[str] = []
        self._pull_given_up = False
        if push:
            _mirrors.add(self)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            options = dict(self.storage_options)
            options.setdefault("use_listings_cache", False)
            self._fs = fsspec.core.url_to_fs(self.url, **options)[0]
        return self._fs

    def _warn(self, what: str, exc: BaseException) -> None:
        text = scrub(f"{type(exc).__name__}: {exc}", secret_values(self.url, self.storage_options))
        logger.warning("compilation cache %s: %s (%s)", redact_url(self.url), what, text)

    # -- pull --------------------------------------------------------------------------------

    def pull(self, timeout: float = 120.0) -> list[str]:
        """`start_pull`, then `wait_pulled`."""
        self.start_pull(timeout)
        return self.wait_pulled()

    def start_pull(self, timeout: float = 120.0) -> None:
        """Start copying the whole entries in storage that are not here, on a background thread,
        so that the copy overlaps the job's set-up and restore; `wait_pulled` waits for it, up to
        `timeout` seconds from now."""
        if self._puller is not None and self._puller.is_alive():
            return
        self._pull_deadline = time.monotonic() + timeout
        self._pull_given_up, self._pull_result = False, []

        def pull():
            self._pull_result = self._pull()

        self._puller = threading.Thread(target=pull, name="prefect-jax-compile-cache", daemon=True)
        self._puller.start()

    def wait_pulled(self) -> list[str]:
        """Wait for `start_pull`'s copy until its time is up (then the copy goes on in the
        background, and JAX compiles what is not here yet). The names copied; none on a failure
        (logged)."""
        puller = self._puller
        if puller is None:
            return []
        if puller.is_alive() and not self._pull_given_up:
            puller.join(max(0.0, self._pull_deadline - time.monotonic()))
            if puller.is_alive():
                self._pull_given_up = True  # warned once; later calls do not wait
                logger.warning(
                    "compilation cache %s: still copying after its time; "
                    "compiling what is not here yet",
                    redact_url(self.url),
                )
        return [] if puller.is_alive() else self._pull_result

    def _pull(self) -> list[str]:
        temps: list[str] = []
        try:
            os.makedirs(self.local_dir, exist_ok=True)
            fs = self.fs
            try:
                listed = fs.ls(self.url, detail=False)
            except FileNotFoundError:
                listed = []
            stored = {
                n
                for n in (p.rstrip("/").rsplit("/", 1)[-1] for p in listed)
                if n.endswith(ENTRY_SUFFIX)
            }
            with self._lock:
                # Not copied back, even if they arrive here after pull's timeout.
                self._stored |= stored
            missing = sorted(stored - set(local_entries(self.local_dir)))
            temps = [
                os.path.join(self.local_dir, f".{name}.tmp-{uuid.uuid4().hex}") for name in missing
            ]
            if missing:  # concurrent where the file system is async
                fs.get([f"{self.url}/{name}" for name in missing], temps)
            copied, cut = [], []
            for name, temp in zip(missing, temps, strict=True):
                with open(temp, "rb") as f:
                    whole = is_whole_entry(f.read())
                if not whole:
                    os.remove(temp)
                    cut.append(name)
                    continue
                install_entry(self.local_dir, name, temp)
                copied.append(name)
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be read: compile instead
            for temp in temps:
                try:
                    os.remove(temp)
                except OSError:
                    pass
            self._warn("could not be read; compiling what it lacks", exc)
            return []
        with self._lock:
            self._stored -= set(cut)  # compiled here, then copied over the cut one
            self.pulled += copied
        if cut:
            logger.warning(
                "compilation cache %s: %d entries in storage are cut short (%s); they are "
                "compiled here and copied over",
                redact_url(self.url),
                len(cut),
                ", ".join(cut),
            )
        if copied:
            logger.info(
                "compilation cache: %d entries copied from %s to %s",
                len(copied),
                redact_url(self.url),
                self.local_dir,
            )
        return copied

    # -- push --------------------------------------------------------------------------------

    def push_async(self) -> None:
        """Copy the entries made here that are not in storage, on the background thread (an entry
        JAX is still writing is copied by a later call). Never raises: a failure is logged."""
        if not self.can_push:
            return
        try:
            with self._lock:
                known = self._stored | self._pending | self._copying
            new = {
                n
                for n, stat in local_entries(self.local_dir).items()
                if n not in known and self._partial.get(n) != stat
            }
            if not new:
                return
            with self._lock:
                self._pending |= new
                if self._thread is not None:
                    return
                thread = self._thread = threading.Thread(
                    target=self._push_pending, name="prefect-jax-compile-cache", daemon=True
                )
            try:
                thread.start()
            except BaseException:
                with self._lock:
                    self._thread = None
                raise
        except Exception as exc:  # noqa: BLE001 - copying is an optimisation
            self._warn("could not copy entries", exc)

    def _push_pending(self) -> None:
        """The background thread: copy what is pending until nothing is."""
        while True:
            with self._lock:
                names, self._pending = sorted(self._pending), set()
                self._copying = set(names)
                if not names:
                    self._thread = None
                    return
            try:
                batch: dict[str, bytes] = {}
                size = 0
                for name in names:
                    path = os.path.join(self.local_dir, name)
                    try:
                        stat = os.stat(path)
                        with open(path, "rb") as f:
                            data = f.read()
                    except FileNotFoundError:  # evicted by JAX
                        continue
                    if not is_whole_entry(data):  # still being written, or cut short: a later push
                        self._partial[name] = (stat.st_size, stat.st_mtime_ns)
                        continue
                    self._partial.pop(name, None)
                    batch[name] = data
                    size += len(data)
                    if size >= PUSH_BATCH_BYTES:
                        self._put(batch)
                        batch, size = {}, 0
                if batch:
                    self._put(batch)
            except Exception as exc:  # noqa: BLE001 - the next push tries again
                self._warn("could not copy entries", exc)

    def _put(self, batch: dict[str, bytes]) -> None:
        # The bytes checked; one PUT each on object stores.
        self.fs.pipe({f"{self.url}/{name}": data for name, data in batch.items()})
        with self._lock:
            self._stored.update(batch)
            self.pushed += sorted(batch)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the copies under way; True if none is left."""
        with self._lock:
            running = self._thread
        if running is None:
            return True
        try:
            running.join(max(0.0, timeout))
        except RuntimeError:  # not started yet: a signal handler inside push_async
            return False
        return not running.is_alive()

    def flush(self, timeout: float = END_FLUSH_SECS) -> bool:
        """`push_async`, then `wait` up to `timeout` seconds: True if no copy is left under way (a
        process may end without the rest: a rerun elsewhere compiles it again)."""
        self.push_async()
        return self.wait(timeout)


_mirrors: weakref.WeakSet[CompileCacheMirror] = weakref.WeakSet()


@atexit.register
def _wait_at_exit() -> None:
    """At the process's exit, let the copies under way finish (up to `END_FLUSH_SECS`), unless a
    SIGTERM came: its handler waited within the grace already."""
    preemption = sys.modules.get("prefect_jax.training.preemption")
    if preemption is not None and preemption.received_signal() is not None:
        return
    deadline = time.monotonic() + END_FLUSH_SECS
    for mirror in list(_mirrors):
        mirror.wait(deadline - time.monotonic())
