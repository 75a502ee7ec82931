"""A real GCS JSON API on loopback for tests: gcp-storage-emulator in a subprocess.

Orbax writes ``gs://`` itself: its arrays through TensorStore's GCS driver, its other files
through `etils.epath` (gcsfs). Both are pointed at the emulator by environment variables
(`GCSServer.env`), the way a developer points them at any GCS endpoint; nothing else on the
network is reached.

Example:
    ```python
    with GCSServer(bucket="jobs") as gcs:
        env = {**os.environ, **gcs.env}   # for a process that trains on gs://jobs/...
    ```
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

from s3_server import free_port


class GCSServer:
    """gcp-storage-emulator on 127.0.0.1:<free port>, in memory, with one bucket, for the
    duration of a `with` block.

    Attributes:
        url: ``http://127.0.0.1:<port>``.
        env: the environment that sends gcsfs and TensorStore there (and gives TensorStore a
            token: it asks for credentials even of an emulator).
    """

    def __init__(self, bucket: str, startup_timeout: float = 60.0):
        self.bucket, self.port = bucket, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            "STORAGE_EMULATOR_HOST": self.url,  # gcsfs (and google-cloud-storage)
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
        }
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> GCSServer:
        cli = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [cli, "start", "--host", "127.0.0.1", "--port", str(self.port), "--in-memory"]
            + ["--default-bucket", self.bucket],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the GCS emulator exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the GCS emulator did not listen on {self.url}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> GCSServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
