"""Content checksums of a checkpoint step: a manifest of its files' sizes and CRC32s.

Written in Orbax's commit (after the items are final, before the step directory is renamed
into place) and checked on restore, so that a step whose bytes changed since (bit rot, a bad
disk or copy, an edit) is refused instead of resumed from. Imports neither jax nor Orbax.
"""

from __future__ import annotations

import json
import os
import threading
import zlib

from prefect_jax.training.names import GCS_COMMIT_FILE, ORBAX_COMMIT_FILE, STEP_MANIFEST_FILE

# Written or rewritten by Orbax around the commit, after the manifest: not covered by it.
_UNCHECKED = {ORBAX_COMMIT_FILE, STEP_MANIFEST_FILE, GCS_COMMIT_FILE}


class CorruptCheckpointError(OSError):
    """A committed step's files differ from the checksums written with it (bit rot, a bad
    disk or copy, an edit): restoring it would resume from silently wrong values."""

    def __init__(self, step_dir: str, problems: list[str]):
        self.step_dir, self.problems = step_dir, problems
        more = f"; ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        shown = "; ".join(problems[:5]) + more
        super().__init__(
            f"checkpoint {step_dir} is corrupt ({shown}): its files differ from the checksums "
            "written at its commit"
        )


# A file is read and checksummed in blocks of this size, on several threads (zlib's CRC32 and
# the reads release the GIL): one thread's CRC32 of a large state, read back from the page cache
# at the commit, is on the way of the final checkpoint and of a SIGTERM's grace period. On a CPU
# the threads take cores from the training for less time, not for more CPU time in all.
_BLOCK = 64 << 20
_READ = 4 << 20
_MAX_THREADS = 8


def _crc32_of_range(path: str, offset: int, length: int) -> int:
    crc, left = 0, length
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while left > 0 and (chunk := f.read(min(_READ, left))):
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
    if left:
        raise OSError(f"{path} changed while it was checksummed ({left} bytes short)")
    return crc


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC32 of A + B from ``crc32(A)``, ``crc32(B)`` and ``len(B)``: zlib's
    ``crc32_combine`` (which Python's zlib does not expose), by multiplying ``crc1`` by
    ``x^(8 * length2)`` modulo CRC32's polynomial."""
    if length2 < 0:
        raise ValueError(f"length2={length2}: a length, not below 0")
    return _multmodp(_x8nmodp(length2), crc1) ^ crc2


_POLY = 0xEDB88320  # CRC32's polynomial, bit-reversed as zlib computes


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the polynomial, as zlib's `multmodp` (`a` is never 0 here: a power of x)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, from x^1
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial: n bytes of zeros shift a CRC by that factor."""
    p, k = 1 << 31, 3  # x^0; 8n = n << 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def file_crc32s(paths: list[str]) -> list[tuple[int, int]]:
    """The (size, CRC32) of each file, its blocks read and checksummed by this thread and up to
    `_MAX_THREADS` - 1 daemon threads: never threads the process's exit waits for, nor a pool
    that refuses work once the interpreter shuts down (Orbax's commit thread may outlive it).

    Raises:
        OSError: a file could not be read, or changed size while it was read.
    """
    sizes = [os.path.getsize(path) for path in paths]
    blocks = [
        (i, offset, min(_BLOCK, size - offset))
        for i, size in enumerate(sizes)
        for offset in range(0, max(size, 1), _BLOCK)
    ]
    crcs: list[int] = [0] * len(blocks)
    errors: list[BaseException] = []
    lock, todo = threading.Lock(), iter(range(len(blocks)))

    def work() -> None:
        while not errors:
            with lock:
                j = next(todo, None)
            if j is None:
                return
            i, offset, length = blocks[j]
            try:
                crcs[j] = _crc32_of_range(paths[i], offset, length)
            except BaseException as exc:  # noqa: BLE001 - raised below, on the caller's thread
                errors.append(exc)

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    helpers = []
    for _ in range(min(len(blocks), cpus or 1, _MAX_THREADS) - 1):
        thread = threading.Thread(target=work, name="prefect-jax-crc32", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # (no thread to be had: this one does the rest)
            break
        helpers.append(thread)
    work()
    for thread in helpers:
        thread.join()
    if errors:
        raise errors[0]
    out = [0] * len(paths)
    for (i, _, length), crc in zip(blocks, crcs, strict=True):
        out[i] = crc32_combine(out[i], crc, length)
    return list(zip(sizes, out, strict=True))


def _checked_files(step_dir: str) -> list[str]:
    out = []
    for root, _, files in os.walk(step_dir):
        for name in files:
            if name not in _UNCHECKED:
                out.append(os.path.relpath(os.path.join(root, name), step_dir))
    return sorted(out)


def write_manifest(step_dir: str) -> None:
    """Write ``{file: [size, crc32]}`` of every file of a step (before Orbax's commit renames
    it)."""
    rels = _checked_files(step_dir)
    sized = file_crc32s([os.path.join(step_dir, rel) for rel in rels])
    files = {rel: [size, crc] for rel, (size, crc) in zip(rels, sized, strict=True)}
    tmp = os.path.join(step_dir, STEP_MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"algorithm": "crc32", "files": files}, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, STEP_MANIFEST_FILE))


def verify_manifest(step_dir: str) -> bool:
    """Check a step's files against its manifest; False when it has none (written before checksums).

    Raises:
        CorruptCheckpointError: a file is missing, has another size, or other bytes.
    """
    verification = BackgroundVerification(step_dir, in_background=False)
    return verification.result()


class BackgroundVerification:
    """`verify_manifest` of a step, its CRC32s on a thread of their own beside the restore that
    reads the same files (the reads and CRC32 release the GIL): a large checkpoint is read once
    in the time of one read, not twice in a row. What needs no reading (the manifest, a file
    missing or of another size) is checked here at once, so that the restore never opens a step
    known damaged. `result` waits for the rest: True, False (no manifest), or raises
    `CorruptCheckpointError`.

    Raises:
        CorruptCheckpointError: the manifest is damaged, or a file is missing or of another size.
    """

    def __init__(self, step_dir: str, in_background: bool = True):
        self._step_dir, self._verified, self._error, self._thread = step_dir, False, None, None
        path = os.path.join(step_dir, STEP_MANIFEST_FILE)
        if "://" in step_dir or not os.path.isfile(path):
            return
        try:
            with open(path) as f:
                files = json.load(f)["files"]
            sized = {rel: (int(size), int(crc)) for rel, (size, crc) in sorted(files.items())}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # the manifest: damaged
            raise CorruptCheckpointError(
                step_dir, [f"{STEP_MANIFEST_FILE} is damaged ({type(exc).__name__}: {exc})"]
            ) from None
        problems = []
        for rel, (size, _) in sized.items():
            full = os.path.join(step_dir, rel)
            if not os.path.isfile(full):
                problems.append(f"{rel} is missing")
            elif os.path.getsize(full) != size:
                problems.append(f"{rel} has {os.path.getsize(full)} bytes, {size} were written")
        if problems:
            raise CorruptCheckpointError(step_dir, problems)
        if not in_background:
            self._check_contents(sized)
            return
        self._thread = threading.Thread(
            target=self._check_contents, args=(sized,), name="prefect-jax-verify", daemon=True
        )
        self._thread.start()

    def _check_contents(self, sized: dict[str, tuple[int, int]]) -> None:
        try:
            found = file_crc32s([os.path.join(self._step_dir, rel) for rel in sized])
            problems = [
                f"{rel} has other bytes than were written (crc32 differs)"
                for (rel, (_, crc)), (_, got) in zip(sized.items(), found, strict=True)
                if got != crc
            ]
        except BaseException as exc:  # (an unreadable file: as `verify_manifest` always raised)
            self._error = exc  # raised by `result`, on the restoring thread: never "unverified"
            return
        if problems:
            self._error = CorruptCheckpointError(self._step_dir, problems)
        self._verified = True

    def result(self) -> bool:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._verified
