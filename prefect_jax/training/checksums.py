"""Content checksums of a checkpoint step: a manifest of its files' sizes and CRC32s.

Written in Orbax's commit (after the items are final, before the step directory is renamed
into place) and checked on restore, so that a step whose bytes changed since (bit rot, a bad
disk or copy, an edit) is refused instead of resumed from. Imports neither jax nor Orbax.
"""

from __future__ import annotations

import json
import os
import zlib

from prefect_jax.training.names import STEP_MANIFEST_FILE

ORBAX_COMMIT_FILE = "_CHECKPOINT_METADATA"  # Orbax's, written last at a step's commit
# Written or rewritten by Orbax around the commit, after the manifest: not covered by it.
_UNCHECKED = {ORBAX_COMMIT_FILE, STEP_MANIFEST_FILE, "commit_success.txt"}


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


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


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
    files = {
        rel: [os.path.getsize(os.path.join(step_dir, rel)), _crc32(os.path.join(step_dir, rel))]
        for rel in _checked_files(step_dir)
    }
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
    path = os.path.join(step_dir, STEP_MANIFEST_FILE)
    if "://" in step_dir or not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, TypeError) as exc:  # the manifest itself is damaged
        raise CorruptCheckpointError(
            step_dir, [f"{STEP_MANIFEST_FILE} is damaged ({type(exc).__name__}: {exc})"]
        ) from None
    problems = []
    for rel, (size, crc) in sorted(files.items()):
        full = os.path.join(step_dir, rel)
        if not os.path.isfile(full):
            problems.append(f"{rel} is missing")
        elif os.path.getsize(full) != size:
            problems.append(f"{rel} has {os.path.getsize(full)} bytes, {size} were written")
        elif _crc32(full) != crc:
            problems.append(f"{rel} has other bytes than were written (crc32 differs)")
    if problems:
        raise CorruptCheckpointError(step_dir, problems)
    return True
