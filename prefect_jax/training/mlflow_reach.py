"""Whether a job's MLflow tracking URI can be used, asked once before the job starts.

A URI MLflow does not support, or a store that does not answer, would otherwise be found only by
the background calls, as warnings, after the whole job trained with nothing recorded. A server
is asked in a short-lived child process (`start_check`, `Probe`): MLflow's import stays out of
the command's process, runs beside the program's, and the child alone gets MLflow's public
settings for one quick try (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``MLFLOW_HTTP_REQUEST_TIMEOUT``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from prefect_jax.training.mlflow_store import sqlite_path
from prefect_jax.training.redaction import redact_url, scrub, secret_values

PROBE_TIMEOUT_SECS = 60.0  # the child's whole life: MLflow's import, then one request
_REQUEST_TIMEOUT_SECS = "10"
_PROBE = """
import sys
try:
    from mlflow.tracking import MlflowClient
    MlflowClient(tracking_uri=sys.argv[1]).search_experiments(max_results=1)
except Exception as exc:
    text = str(exc).strip().splitlines()
    print(f"{type(exc).__name__}: {text[0][:500] if text else ''}")
    sys.exit(3)
"""
_STORES = "(sqlite:///<dir>/mlflow.db, http://<host>:5000 of a running 'mlflow server')"
# How each way of giving the URI is named, with its fix and its way to go on without MLflow.
COMMAND, FLOW, ENVIRONMENT = "--mlflow-tracking-uri", "mlflow_tracking_uri", "MLFLOW_TRACKING_URI"
_FIXES = {
    COMMAND: f"give --mlflow-tracking-uri a store MLflow answers at {_STORES}, or pass "
    "--mlflow-optional to train without it",
    FLOW: f"give the flow's mlflow_tracking_uri a store MLflow answers at {_STORES}, or run it "
    "with mlflow_optional=true to train without it",
    ENVIRONMENT: f"set MLFLOW_TRACKING_URI (the work pool's environment, the flow run's) to a "
    f"store MLflow answers at {_STORES}, or run the flow with mlflow_optional=true to train "
    "without it",
}
_OPTIONAL = {COMMAND: "--mlflow-optional", FLOW: "mlflow_optional", ENVIRONMENT: "mlflow_optional"}


class TrackingUnreachableError(ValueError):
    """The MLflow tracking URI is not one MLflow supports, or its store does not answer."""


class Probe:
    """One question to the tracking store, started at once; `check` gets its answer."""

    def __init__(self, uri: str, named: str = COMMAND):
        self.uri, self.named = uri, named  # (named: how the user gave it, a key of `_FIXES`)
        self.safe = redact_url(uri)
        self.error: str | None = None
        self.process: subprocess.Popen | None = None
        scheme = uri.split("://", 1)[0] if "://" in uri else ""
        if scheme in ("", "file", "sqlite") and not uri.startswith("databricks"):
            self.error = _local_store_error(uri, scheme)  # (told without MLflow's import)
            return
        env = {
            **os.environ,
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": _REQUEST_TIMEOUT_SECS,
        }
        self.process = subprocess.Popen(
            [sys.executable, "-c", _PROBE, uri],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
        )

    @property
    def answered(self) -> bool:
        """Whether `check` answers without waiting: a local store (looked at without asking
        MLflow), or a server's probe already checked."""
        return self.process is None

    def check(self, timeout: float = PROBE_TIMEOUT_SECS) -> str | None:
        """None if the store answered (or is a local one whose folder exists), else the message of
        a `TrackingUnreachableError`."""
        if self.process is not None:
            try:
                out, _ = self.process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.communicate()
                out = f"no answer within {timeout:g}s"
                self.process.returncode = 3
            if self.process.returncode != 0:
                cause = scrub(
                    (out or "").strip() or f"exit {self.process.returncode}", self._secrets
                )
                self.error = f"MLflow cannot use it ({cause})"
            self.process = None
        if self.error is None:
            return None
        return (
            f"{self.named} {self.safe}: {self.error}; {_FIXES[self.named]} (nothing of the job "
            "is sent to it then)"
        )

    def close(self) -> None:
        """End the question if it is still asked (a refusal came first)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.communicate()

    @property
    def _secrets(self) -> list[str]:
        return secret_values(self.uri, None)


def _local_store_error(uri: str, scheme: str) -> str | None:
    """What MLflow would refuse of a local store, `uri` (MLflow makes it on first use, in a
    folder that must exist: `mlflow_store`), or None."""
    rest = uri.split("://", 1)[-1]
    if scheme == "sqlite":
        if rest and not rest.startswith("/"):  # (SQLAlchemy's forms: MLflow failed later)
            return (
                "not a SQLite URL: give sqlite:///<relative path>.db or "
                "sqlite:////<absolute path>.db (three slashes, then the path)"
            )
        path = sqlite_path(uri) or ""
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and not path.startswith(":memory:") and not os.path.isdir(folder):
            return f"the folder of its SQLite file, {folder}, does not exist"
        return None
    if scheme == "" and re.fullmatch(r"[\w.-]+:\d+(/.*)?", uri):
        return f"a server without its scheme: give http://{uri} (or https://)"
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("true", "1"):
        return None
    return (
        "a folder, MLflow's file store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE="
        "true is set (a SQLite file in a folder works: sqlite:///<folder>/mlflow.db)"
    )


_checked_uris: set[str] = set()  # tracking URIs this process checked already (and went on)
_unusable_uris: set[str] = set()  # of those, the ones MLflow could not use (--mlflow-optional)


def found_unusable(tracking_uri: str | None) -> bool:
    """Whether this process's check found `tracking_uri` unusable and went on without it
    (``--mlflow-optional``): its trackers then make no MLflow call at all. Each would otherwise
    wait out MLflow's own retries against a store that does not answer (minutes per call, for a
    server), and the job's end would wait for all of them."""
    return tracking_uri in _unusable_uris


def start_check(
    tracking_uri: str | None, optional: bool = False, named: str = COMMAND
) -> Probe | None:
    """Start asking the tracking store at `tracking_uri` whether it answers (see `Probe.check`);
    None: no URI given, one this process checked already (and, unless `optional`, found usable:
    a job that may not go on without MLflow asks again a store an earlier optional job went on
    without), or a process that writes no MLflow run."""
    from prefect_jax.training.cluster_config import leads_from_env

    if not tracking_uri or not leads_from_env():
        return None
    if tracking_uri in _checked_uris and (optional or tracking_uri not in _unusable_uris):
        return None
    return Probe(tracking_uri, named)


def finish_check(probe: Probe, optional: bool) -> None:
    """Refuse the tracking URI that `probe` found unusable; with `optional`, warn instead.

    Raises:
        TrackingUnreachableError: MLflow cannot use the URI, and not `optional`.
    """
    import warnings

    from prefect_jax.training.mlflow_client import TrackingWarning

    problem = probe.check()
    if problem is not None and not optional:
        raise TrackingUnreachableError(problem)
    _checked_uris.add(probe.uri)
    if problem is None:
        _unusable_uris.discard(probe.uri)  # (back since an earlier check: sent to again)
    else:
        _unusable_uris.add(probe.uri)
        warnings.warn(
            f"{problem}. {_OPTIONAL[probe.named]}: training goes on, and its summary says what "
            "did not reach MLflow",
            TrackingWarning,
            stacklevel=3,
        )


def check_tracking_uri(
    tracking_uri: str | None, optional: bool = False, named: str = COMMAND
) -> None:
    """Refuse a tracking URI that MLflow does not support or whose store does not answer (each
    URI is asked once per process: a command's flow does not ask again what it asked).

    Args:
        tracking_uri: The job's MLflow tracking URI (None: the default, a local SQLite store).
        optional: Warn instead of refusing (``--mlflow-optional``, the flows' ``mlflow_optional``).
        named: How the user gave the URI, for messages: `COMMAND`, `FLOW` or `ENVIRONMENT`.

    Raises:
        TrackingUnreachableError: MLflow cannot use the URI (a ``ValueError``), unless `optional`.
    """
    probe = start_check(tracking_uri, optional, named)
    if probe is not None:
        try:
            finish_check(probe, optional)
        finally:
            probe.close()
