"""Where one job's files live, through fsspec.

Layout of one job under a storage root::

    <root>/<job>/checkpoints/<step>/...            Orbax step (state, data iterator, metadata)
    <root>/<job>/evals/<eval-name>/<step>.json     this step was evaluated, with its metrics
    <root>/<job>/exports/<exporter>/<step>/        serving artifact
    <root>/<job>/exports/<exporter>/best.json      best value so far (BestExporter)

Everything except the Orbax step goes through fsspec, so it works on any protocol fsspec
reaches. Orbax itself writes local absolute paths and ``gs://``.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec

from prefect_jax.training.specs import check_name

ORBAX_PROTOCOLS = ("file", "local", "gs", "gcs")


def normalize_root(url: str) -> str:
    """Turn a storage URL into an absolute URL or path; local paths become absolute."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"storage URL {url!r} is empty: give a local directory or a URL such as gs://bucket/prefix")
    url = url.strip()
    if "://" not in url:
        return os.path.abspath(os.path.expanduser(url))
    if url.startswith("file://"):
        return os.path.abspath(url[len("file://"):])
    return url.rstrip("/")


@dataclass(frozen=True)
class JobStorage:
    """The files of one job under one storage root.

    Args:
        root: storage URL (local path, ``file://``, ``gs://``, ...).
        job: job name: letters, digits, ``_ . -``.
    """

    root: str
    job: str

    def __post_init__(self):
        object.__setattr__(self, "root", normalize_root(self.root))
        check_name("job", self.job)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        fs, _ = fsspec.core.url_to_fs(self.root)
        return fs

    @property
    def protocol(self) -> str:
        return self.root.split("://", 1)[0] if "://" in self.root else "file"

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), self.job, *parts])

    @property
    def job_dir(self) -> str:
        return self.path()

    @property
    def checkpoint_dir(self) -> str:
        if self.protocol not in ORBAX_PROTOCOLS:
            raise ValueError(
                f"storage {self.root!r}: Orbax writes checkpoints to local paths and gs:// only, not "
                f"{self.protocol}://; use a local directory (or a mounted volume) or a gs:// bucket"
            )
        return self.path("checkpoints")

    def eval_dir(self, eval_name: str) -> str:
        return self.path("evals", check_name("eval name", eval_name))

    def export_dir(self, exporter: str, step: int | None = None) -> str:
        base = self.path("exports", check_name("exporter name", exporter))
        return base if step is None else f"{base}/{int(step)}"

    # -- small JSON files ------------------------------------------------------------

    def read_json(self, path: str) -> Any | None:
        fs = self.fs
        try:
            with fs.open(path, "r") as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def write_json(self, path: str, obj: Any) -> None:
        """Write JSON so a reader never sees half a file (rename on local disks; one PUT elsewhere)."""
        data = json.dumps(obj, indent=1, sort_keys=True).encode()
        fs = self.fs
        parent = path.rsplit("/", 1)[0]
        fs.makedirs(parent, exist_ok=True)
        if self.protocol == "file":
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            fs.pipe_file(path, data)

    def list_int_names(self, path: str) -> list[int]:
        """Integer-named entries directly under `path` (``<step>`` dirs or ``<step>.json`` files), sorted."""
        fs = self.fs
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
        except FileNotFoundError:
            return []
        steps = []
        for name in names:
            stem = name[:-5] if name.endswith(".json") else name
            if stem.isdigit():
                steps.append(int(stem))
        return sorted(steps)
