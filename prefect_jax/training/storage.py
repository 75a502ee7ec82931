"""Where one job's files live, through fsspec.

Layout of one job under a storage root::

    <root>/<job>/checkpoints/<step>/...            Orbax step (state, data iterator, metadata)
    <root>/<job>/evals/<eval-name>/<step>.json     this step was evaluated, with its metrics
    <root>/<job>/exports/<exporter>/<step>/        serving artifact and its export.json
    <root>/<job>/exports/<exporter>/best.json      best step and metrics so far (BestExporter)
    <root>/<job>/lease.json, stop.json, attempts.json, goodput.json, registry.json

The file names are `prefect_jax.training.names`'s (``*_FILE``); docs/storage.md says what each
holds and what writes it.

Everything except the Orbax step goes through fsspec, so it works on any protocol fsspec
reaches. Orbax itself writes local absolute paths and ``gs://``; on other protocols steps are
written to a local staging directory and uploaded (see `prefect_jax.training.remote`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import fsspec

from prefect_jax.training.spec_base import check_name

# Orbax writes these itself: local paths, and GCS URLs (with Google's default credentials)
GCS_PROTOCOLS = ("gs", "gcs")
ORBAX_PROTOCOLS = ("file", "local", *GCS_PROTOCOLS)


def normalize_root(url: str) -> str:
    """Turn a storage URL into an absolute URL or path; local paths become absolute."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(
            f"storage URL {url!r} is empty: give a local directory or a URL such as gs://bucket/prefix"
        )
    url = url.strip()
    if "://" not in url:
        _refuse_a_url_missing_its_colon_slash_slash(url)
        return os.path.abspath(os.path.expanduser(url))
    if url.startswith("file://"):
        return os.path.abspath(url[len("file://") :])
    return url.rstrip("/")


_REMOTE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hdfs", "hf", "oci"}


def _refuse_a_url_missing_its_colon_slash_slash(url: str) -> None:
    """``s3//bucket/prefix`` or ``s3:/bucket/prefix`` is a URL mistyped, not a local folder
    named ``s3``: taken as one, the job would train into the worker's working directory (a
    deployment's git checkout) with no word said."""
    typo = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)(?::/*|//+)(.*)", url)
    # (remote stores only: fsspec also knows `data`, `root`, `local`, `memory`... as protocols,
    # which are folder names too, and `data//runs` is a path a `$BASE/$SUB` makes)
    if typo and typo.group(1).lower() in _REMOTE_PROTOCOLS:
        protocol, rest = typo.groups()
        raise ValueError(
            f"storage {url!r} is a local path, not a {protocol}:// URL (its '://' is mistyped): "
            f"did you mean '{protocol}://{rest}'? (A local folder so named: give './{url}'.)"
        )


def job_digest(root: str, job: str) -> str:
    """A job's identity as hex digits: a hash of its storage root (normalized, credentials
    redacted) and its name, the same for every URL that names the root. Its prefixes name the
    job's default registered model and its Prefect resource."""
    from prefect_jax.training.redaction import redact_url

    return hashlib.sha256(f"{redact_url(normalize_root(root))}\n{job}".encode()).hexdigest()


def atomic_write(path: str, data: bytes, durable: bool = True) -> None:
    """Write a local file so that readers see the old file or the whole new one (temp file, fsync,
    rename).

    ``durable=False`` skips the fsync: the file survives the process (a kill), not the machine."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def json_bytes(obj: Any) -> bytes:
    """How the job's JSON files are written (indented, keys sorted: readable, and diffable)."""
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def small_read(fs) -> dict[str, Any]:
    """Options for `fs.cat_file` of a small file: one GET. (s3fs otherwise asks for the size
    first, to download a large object in parallel parts: a HEAD, and a LIST where it is missing.)"""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return {"max_concurrency": 1} if "s3" in protocols else {}


def cache_root() -> str:
    """Where local copies of remote checkpoints are staged: ``PREFECT_JAX_CACHE_DIR`` or
    ``~/.cache/prefect-jax``."""
    return os.path.abspath(
        os.environ.get("PREFECT_JAX_CACHE_DIR") or os.path.expanduser("~/.cache/prefect-jax")
    )


@dataclass(frozen=True)
class JobStorage:
    """The files of one job under one storage root.

    Args:
        root: storage URL (local path, ``file://``, ``gs://``, ``s3://``, any fsspec URL).
        job: job name: letters, digits, ``_ . -``.
        storage_options: fsspec options for the root's filesystem (an endpoint, for one).
            Credentials may also come from the environment or fsspec's own configuration
            (``FSSPEC_S3_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...).
    """

    root: str
    job: str
    storage_options: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "root", normalize_root(self.root))
        check_name("job", self.job)
        bracketed = re.search(r"\[[^/]*\]", self.root)
        if bracketed and self.orbax_native:
            # Orbax (0.12.8) finds a step's per-process parts with a glob of the step's own path
            # (docs/upstream.md): a name such as `runs[1]` is read as a pattern, the parts are not
            # found, and every step saved there fails to restore.
            raise ValueError(
                f"storage {self.root!r}: a folder named with brackets ({bracketed.group()}) cannot "
                "hold Orbax checkpoints (Orbax reads it as a glob pattern, and the steps it saves "
                "there do not restore). Use a storage path without '[' and ']'."
            )

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        options = dict(self.storage_options)
        if self.protocol != "file":
            options.setdefault("use_listings_cache", False)  # see what other processes wrote
        fs, _ = fsspec.core.url_to_fs(self.root, **options)
        return fs

    @property
    def orbax_native(self) -> bool:
        """Whether Orbax writes this storage itself (local paths, ``gs://``)."""
        return self.protocol in ORBAX_PROTOCOLS

    def check_shared_by(self, processes: int) -> None:
        """Refuse `processes` JAX processes on storage Orbax does not write itself: each would
        stage and upload its own part of one step (the launcher checks before it starts them,
        each `Job` again).

        Raises:
            ValueError: naming the storage and what to use instead.
        """
        if processes > 1 and not self.orbax_native:
            from prefect_jax.training.redaction import redact_url

            raise ValueError(
                f"storage {redact_url(self.root)!r}: {processes} JAX processes write one "
                "checkpoint together, which Orbax does only on storage every process reaches by "
                "path: a shared file system (NFS, a ReadWriteMany volume) or gs://. Use one of "
                "those, or train this job in one process"
            )

    def options_orbax_ignores(self) -> list[str]:
        """The storage options Orbax does not use: on ``gs://`` it reads and writes the steps with
        Google's default credentials (TensorStore, `etils.epath`), so a block's ``token`` or
        ``project`` reach the job's other files only. Elsewhere every option reaches every file."""
        return sorted(self.storage_options) if self.protocol in GCS_PROTOCOLS else []

    @property
    def remote_checkpoint_url(self) -> str | None:
        """The checkpoints URL on storage Orbax cannot write (steps are staged locally, then
        uploaded)."""
        return None if self.orbax_native else self.path("checkpoints")

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
        """Where Orbax writes: the job's checkpoints, or their local staging copy for other
        protocols."""
        return self.path("checkpoints") if self.orbax_native else self.staging_dir("checkpoints")

    def staging_dir(self, *parts: str) -> str:
        """A local directory for this job's files on this machine (under `cache_root`, one per
        storage root)."""
        digest = hashlib.sha256(self.root.encode()).hexdigest()[:16]
        return os.path.join(cache_root(), digest, self.job, *parts)

    def eval_dir(self, eval_name: str) -> str:
        return self.path("evals", check_name("eval name", eval_name))

    def eval_names(self) -> list[str]:
        """The eval names the job has records of (`eval_dir`'s), sorted."""
        try:
            found = self.fs.ls(self.path("evals"), detail=False)
        except FileNotFoundError:
            return []
        return sorted(path.rstrip("/").rsplit("/", 1)[-1] for path in found)

    def export_dir(self, exporter: str, step: int | None = None) -> str:
        base = self.path("exports", check_name("exporter name", exporter))
        return base if step is None else f"{base}/{int(step)}"

    def check_writable(self) -> None:
        """Raise `StorageNotWritableError` naming the root unless a file can be written (and
        removed) in the job's directory, or in the root where the job has none yet (the job's
        first write makes it; a probe leaves no empty job behind, as an evaluator of a mistyped
        job would): a refused write is found before the job changes anything."""
        from prefect_jax.training.errors import StorageNotWritableError

        probe = self.path(f".write-probe-{uuid.uuid4().hex}")
        try:
            if self.protocol == "file":
                if not os.path.lexists(self.job_dir):  # (a file there: probed inside, refused)
                    os.makedirs(self.root, exist_ok=True)
                    probe = f"{self.root.rstrip('/')}/.write-probe-{uuid.uuid4().hex}"
                with open(probe, "wb"):
                    pass
                os.remove(probe)
            else:
                fs = self.fs
                fs.pipe_file(probe, b"")
                fs.rm_file(probe)
        except OSError as exc:
            if isinstance(exc, PermissionError) or exc.errno in (
                errno.EACCES,
                errno.EPERM,
                errno.EROFS,
            ):
                from prefect_jax.training.redaction import redact_url, scrub, secret_values

                cause = type(exc)(scrub(str(exc), secret_values(self.root, self.storage_options)))
                raise StorageNotWritableError(redact_url(self.root), cause) from None
            raise

    def jobs_there(self) -> list[str]:
        """The names of the jobs (folders) in this storage's root, sorted ([] where it has none)."""
        fs = self.fs
        try:
            listed = fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        names = (
            e["name"].rstrip("/").rsplit("/", 1)[-1] for e in listed if e["type"] == "directory"
        )
        return sorted(name for name in names if not name.startswith("."))  # (no job is hidden)

    def jobs_there_said(self) -> str:
        """`jobs_there` for a message: ``jobs there: a, b``, or ``no job there at all``."""
        jobs = self.jobs_there()
        return f"jobs there: {', '.join(jobs)}" if jobs else "no job there at all"

    def no_such_job_said(self) -> str | None:
        """Where this job has no folder at all (a mistyped name, say): ``storage R has no job
        'x'; jobs there: a, b``, for a message; None where it has one."""
        if self.fs.exists(self.job_dir):
            return None
        from prefect_jax.training.redaction import redact_url

        return f"storage {redact_url(self.root)} has no job {self.job!r}; {self.jobs_there_said()}"

    # -- small JSON files ------------------------------------------------------------

    def read_json(self, path: str) -> Any | None:
        """The JSON file at `path`, or None when there is none. One read: on object storage one
        GET (opening the file first asked for its size: a HEAD, and a LIST where it is missing,
        as a stop request and a step's eval record mostly are), and never a cached listing."""
        try:
            data = self.fs.cat_file(path, **small_read(self.fs))
        except FileNotFoundError:
            return None
        return json.loads(data)

    def write_json(self, path: str, obj: Any, durable: bool = True) -> None:
        """Write JSON so a reader never sees half a file (rename on local disks; one PUT elsewhere).
        ``durable=False``: no fsync on local disks (see `atomic_write`)."""
        data = json_bytes(obj)
        if self.protocol == "file":
            os.makedirs(
                path.rsplit("/", 1)[0], exist_ok=True
            )  # object stores have no directories (and must not create buckets)
            atomic_write(path, data, durable)
        else:
            self.fs.pipe_file(path, data)

    def list_int_names(self, path: str) -> list[int]:
        """Integer-named entries directly under `path` (``<step>`` dirs or ``<step>.json`` files),
        sorted."""
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
