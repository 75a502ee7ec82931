"""A real MLflow tracking server on loopback for tests and the fault sweep: ``mlflow server`` with
a SQLite backend, in its own process group, so that it can be SIGKILLed and started again on
the same port (an outage of the store, as a job sees it).

Example:
    ```python
    server = MlflowServerProcess(tmp_path, free_port())
    server.start()
    ...  # a job tracking to server.uri
    server.kill()
    server.start()  # back on its port, its store as it was
    ```
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from process_helpers import wait_healthy


class MlflowServerProcess:
    """``mlflow server`` on 127.0.0.1:`port`, its store ``<work>/mlflow-server.db``, its log of
    each start in `log_dir` (default `work`)."""

    def __init__(self, work: Path, port: int, log_dir: Path | None = None):
        self.work, self.port, self.log_dir = work, port, log_dir or work
        self.uri = f"http://127.0.0.1:{port}"
        self.db = work / "mlflow-server.db"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout: float = 180) -> None:
        """Start the server and wait until it answers its health check."""
        self.starts += 1
        log = self.log_dir / f"mlflow-server-{self.starts}.log"
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [
                    *(str(Path(sys.executable).parent / "mlflow"), "server"),
                    *("--backend-store-uri", f"sqlite:///{self.db}"),
                    *("--artifacts-destination", str(self.work / "mlflow-artifacts")),
                    *("--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.work,
                start_new_session=True,
            )
        tail = lambda: log.read_text()[-3000:]  # noqa: E731
        wait_healthy(f"{self.uri}/health", self.proc, "mlflow server", tail, timeout, 0.2)

    def kill(self) -> None:
        """SIGKILL the server's whole process group (its workers too)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def last_step(self, key: str) -> int:
        """The highest step of metric `key` in the server's store (-1: none yet)."""
        try:
            with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5) as db:
                row = db.execute("SELECT max(step) FROM metrics WHERE key = ?", (key,)).fetchone()
        except sqlite3.Error:
            return -1
        return -1 if row is None or row[0] is None else row[0]
