"""The job's small JSON records read with their damage named: a record that is there but is not
JSON (a write torn by a full disk or a crash on storage without atomic renames, bit rot, an edit)
is never read as absent and silently written over.

Each record has one of two outcomes when damaged: rebuilt from what it summarises (an eval record:
the evaluation of its committed step is redone; the goodput ledger: started again, the damaged copy
kept beside it), or named in a clear error with the fix. `damaged_records` lists them all for
``prefect-jax status``. Imports neither jax nor Orbax.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

logger = logging.getLogger("prefect_jax.records")


class DamagedRecordError(ValueError):
    """A record of the job exists but cannot be read as JSON."""

    def __init__(self, path: str, cause: BaseException, fix: str = ""):
        self.path = path
        super().__init__(
            f"the record {path} is damaged ({type(cause).__name__}: {cause})"
            + (f"; {fix}" if fix else "")
        )


def read_record(storage, path: str, fix: str = "") -> Any | None:
    """`JobStorage.read_json`, with a file that is not JSON named.

    Raises:
        DamagedRecordError: the file is there but not JSON (``fix`` says what to do about it).
    """
    try:
        return storage.read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DamagedRecordError(path, exc, fix) from None


def set_aside(storage, path: str) -> str:
    """Move a damaged record to ``<path>.damaged-<time>`` (kept for whoever looks into it);
    returns where."""
    dst = f"{path}.damaged-{int(time.time())}"
    storage.fs.mv(path, dst)
    return dst


def damaged_records(storage) -> list[dict[str, str]]:
    """Every JSON record under the job's directory that is not JSON: ``[{path, error}]``."""
    try:
        found = storage.fs.find(storage.job_dir)
    except FileNotFoundError:
        return []
    out = []
    for path in sorted(p for p in found if p.endswith(".json") and "/checkpoints/" not in p):
        try:
            read_record(storage, path if "://" not in storage.job_dir else _url(storage, path))
        except DamagedRecordError as exc:
            out.append({"path": exc.path, "error": str(exc)})
        except Exception:  # noqa: BLE001 - unreadable for another reason: not damage to report
            continue
    return out


def _url(storage, path: str) -> str:
    """A path `fs.find` listed, as the URL `read_json` takes."""
    return f"{storage.protocol}://{path}" if "://" not in path else path
