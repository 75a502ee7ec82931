"""What one checkpoint step is on remote storage and in a local copy of it.

Remote layout of one job's checkpoints::

    <url>/<step>/...                       the files of the Orbax step, as Orbax wrote them
    <url>/<step>/_PREFECT_JAX_COMMITTED    JSON manifest (files and sizes, upload id); written last

A local copy holds the same files and the same marker, so a copy already there from the same
upload is known without downloading it again. (Where a download lands before it takes the step's
name, and what a killed one leaves: `prefect_jax.training.leftovers`.)
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass

from prefect_jax.training.names import COMMIT_MARKER

MARKER_FORMAT = 1

# Protocols fsspec resolves to the local disk: markers are written with a rename there.
LOCAL_PROTOCOLS = ("file", "local")
# Object stores: no directories to create (so no bucket is created by accident), and their fsspec
# implementations cache listings, which must see steps other processes commit.
OBJECT_STORE_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2")


def protocol_of(url: str) -> str:
    last = url.split("::")[0]
    return last.split("://", 1)[0] if "://" in last else "file"


def local_tree(local_dir: str) -> tuple[list[str], dict[str, int]]:
    """(sub-directories, {file: size}) under `local_dir`, as sorted ``/``-separated relative
    paths."""
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
            {
                "format": MARKER_FORMAT,
                "step": self.step,
                "files": self.files,
                "dirs": self.dirs,
                "upload_id": self.upload_id,
                "uploaded_at": self.uploaded_at,
                "host": socket.gethostname(),
                "pid": os.getpid(),
            },
            indent=1,
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> StepManifest | None:
        try:
            obj = json.loads(data)
            return cls(
                int(obj["step"]),
                {str(k): int(v) for k, v in obj["files"].items()},
                [str(d) for d in obj.get("dirs", [])],
                str(obj["upload_id"]),
                float(obj.get("uploaded_at", 0)),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def local_copy_matches(path: str, manifest: StepManifest) -> bool:
    """A local step directory is a complete copy of the upload `manifest` describes."""
    try:
        with open(os.path.join(path, COMMIT_MARKER), "rb") as f:
            local = StepManifest.from_json(f.read())
    except OSError:
        return False
    if local is None or local.upload_id != manifest.upload_id:
        return False
    try:
        return all(
            os.path.getsize(os.path.join(path, *f.split("/"))) == size
            for f, size in manifest.files.items()
        )
    except OSError:
        return False
