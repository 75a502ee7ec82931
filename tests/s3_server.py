"""A real S3 API on loopback for tests: moto's server in a subprocess.

Only 127.0.0.1 is used; nothing else on the network is reached. The server runs in its own
process so that it serves uploads in parallel with the test (and with the processes a test
starts and kills).

Example:
    ```python
    with S3Server() as s3:
        s3.create_bucket("ckpt")
        fs = fsspec.filesystem("s3", **s3.storage_options)
    ```

As pytest fixtures (see tests/test_remote.py)::

    @pytest.fixture(scope="module")
    def s3():
        with S3Server() as server:
            server.create_bucket("ckpt")
            yield server
"""

from __future__ import annotations

import os
import sys
import time

from loopback_server import LoopbackServer, free_port

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"

# Keep boto from reading the developer's AWS config or asking an instance-metadata endpoint
# (which is not loopback) for credentials.
ISOLATED_AWS_ENV = {
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_DEFAULT_REGION": REGION,
}
UNSET_AWS_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
)


def isolate_aws_env(environ=os.environ) -> None:
    """Point boto's credential chain at nothing but what a test passes explicitly."""
    for name in UNSET_AWS_ENV:
        environ.pop(name, None)
    environ.update(ISOLATED_AWS_ENV)


def closed_port() -> int:
    """A loopback port that refuses connections (bound and released: nothing listens)."""
    return free_port()


def storage_options(
    endpoint_url: str, key: str = ACCESS_KEY, secret: str = SECRET_KEY, **extra
) -> dict:
    """s3fs storage options for a loopback endpoint: explicit
    credentials, short timeouts, few retries."""
    options = {
        "key": key,
        "secret": secret,
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": REGION},
        "config_kwargs": {
            "connect_timeout": 2,
            "read_timeout": 30,
            "retries": {"max_attempts": 2, "mode": "standard"},
        },
        "skip_instance_cache": True,
    }
    options.update(extra)
    return options


def _file(path) -> str:
    return str(path or "").rstrip("/").rsplit("/", 1)[-1]


class StorageCalls:
    """What a job asks object storage, counted where it is asked, in this process:

    - ``requests``: every request that reaches S3 (any thread), per (operation, file), as
      aiobotocore sends it (s3fs's calls may send several: a HEAD before a GET, a LIST after a
      HEAD that found nothing);
    - ``calls[part]``: the fsspec calls the main thread waits for (made there or on the
      trainer's thread), per (call, file), while the innermost of `parts` on its stack is
      ``part`` (``"train_loop"``: a flow's intervals; ``"restore_trainer"``: a restore);
      ``secs[part]``: their wall time.

    `install(setattr)` patches aiobotocore and fsspec (`monkeypatch.setattr` in a test, so that
    it is undone; the builtin in a benchmark's own process)."""

    def __init__(self, parts: tuple[str, ...] = ("train_loop", "restore_trainer")):
        import collections

        self.parts = parts
        self.requests: collections.Counter = collections.Counter()
        self.calls = {part: collections.Counter() for part in parts}
        self.secs = dict.fromkeys(parts, 0.0)

    def _part(self) -> str | None:
        """The innermost of `parts` on this thread's stack, or, on the trainer's thread (where
        the tasks run the trainer's calls), on the stack of the main thread waiting for it."""
        import threading

        from prefect_jax.training import trainer_thread

        stacks = [sys._getframe(2)]
        if trainer_thread.on_trainer_thread():
            stacks.append(sys._current_frames().get(threading.main_thread().ident))
        for frame in stacks:
            while frame is not None:
                if frame.f_code.co_name in self.parts:
                    return frame.f_code.co_name
                frame = frame.f_back
        return None

    def install(self, setattr=setattr) -> None:
        import threading

        import aiobotocore.client
        import fsspec.asyn

        from prefect_jax.training import trainer_thread

        api_call, sync = aiobotocore.client.AioBaseClient._make_api_call, fsspec.asyn.sync

        async def request(client, operation, params):
            self.requests[(operation, _file(params.get("Key") or params.get("Prefix")))] += 1
            return await api_call(client, operation, params)

        def call(loop, func, *args, **kwargs):
            waited_for = threading.current_thread() is threading.main_thread() or (
                trainer_thread.on_trainer_thread()
            )  # (the threads the flow's task runs wait for)
            part = self._part() if waited_for else None
            began = time.perf_counter()
            try:
                return sync(loop, func, *args, **kwargs)
            finally:
                if part is not None:
                    path = next(
                        (a for a in args if isinstance(a, (str, list))), ""
                    )  # (a method's own: after the file system)
                    self.calls[part][(func.__name__, _file(path))] += 1
                    self.secs[part] += time.perf_counter() - began

        setattr(aiobotocore.client.AioBaseClient, "_make_api_call", request)
        setattr(fsspec.asyn, "sync", call)


class S3Server(LoopbackServer):
    """moto's S3 server on 127.0.0.1:<free port>, in a subprocess, for
    the duration of a `with` block.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>``.
        storage_options: s3fs options (key, secret, client_kwargs with endpoint_url and region).
    """

    name = "moto server"

    @property
    def storage_options(self) -> dict:
        return storage_options(self.endpoint_url)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def process_env(self) -> dict[str, str]:
        env = dict(os.environ)
        isolate_aws_env(env)
        env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = ACCESS_KEY, SECRET_KEY
        return env

    def filesystem(self, **extra):
        import fsspec

        extra.setdefault("use_listings_cache", False)  # tests look at what other processes wrote
        return fsspec.filesystem("s3", **storage_options(self.endpoint_url, **extra))

    def create_bucket(self, name: str) -> str:
        """Create a bucket (if missing); returns ``s3://<name>``."""
        fs = self.filesystem()
        if not fs.exists(name):
            # us-east-1 takes no LocationConstraint (s3fs's mkdir would send one).
            fs.call_s3("create_bucket", Bucket=name)
            fs.invalidate_cache()
        return f"s3://{name}"

    def save_block(self, name: str, url: str, secret: str = SECRET_KEY) -> str:
        """Save a CheckpointStorage block for `url` on this server: the endpoint in its options, the
        credentials in its secret options (as a user keeps them). Returns
        ``jax-checkpoint-storage/<name>``."""
        from prefect_jax.blocks import CheckpointStorage

        CheckpointStorage(
            url=url,
            storage_options={
                "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION}
            },
            secret_options={"key": ACCESS_KEY, "secret": secret},
        ).save(name, overwrite=True)
        return f"jax-checkpoint-storage/{name}"
