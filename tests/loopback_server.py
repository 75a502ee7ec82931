"""A test server in a subprocess on 127.0.0.1 for the duration of a `with` block: moto's S3
(`s3_server.S3Server`), fake-gcs-server's GCS (`gcs_server.GCSServer`). Only loopback is
used; the server runs in its own process so that it serves the processes a test starts and kills
while the test goes on."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackServer:
    """`command()` started on `port` with `process_env()`; ready once the port accepts.

    Attributes:
        port: the port on 127.0.0.1.
        endpoint_url: ``http://127.0.0.1:<port>``.
    """

    name = "server"

    def __init__(self, port: int | None = None, startup_timeout: float = 60.0):
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def process_env(self) -> dict[str, str] | None:
        """The server process's environment (None: this process's)."""
        return None

    def start(self):
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=self.process_env()
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"{self.name} did not listen on {self.endpoint_url} within "
            f"{self.startup_timeout:.0f}s:\n{self.log()}"
        )

    def log(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

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

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
