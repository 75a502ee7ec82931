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
import sys

from loopback_server import LoopbackServer


class GCSServer(LoopbackServer):
    """gcp-storage-emulator on 127.0.0.1:<free port>, in memory, with one bucket.

    Attributes:
        env: the environment that sends gcsfs and TensorStore there (and gives TensorStore a
            token: it asks for credentials even of an emulator).
    """

    name = "the GCS emulator"

    def __init__(self, bucket: str, startup_timeout: float = 60.0):
        super().__init__(startup_timeout=startup_timeout)
        self.bucket = bucket
        self.env = {
            "STORAGE_EMULATOR_HOST": self.endpoint_url,  # gcsfs (and google-cloud-storage)
            "TENSORSTORE_GCS_HTTP_URL": self.endpoint_url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
        }

    def command(self) -> list[str]:
        cli = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
        return [cli, "start", "--host", "127.0.0.1", "--port", str(self.port), "--in-memory"] + [
            "--default-bucket",
            self.bucket,
        ]
