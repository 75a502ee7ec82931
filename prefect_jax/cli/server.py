"""The command's Prefect API: the configured one, or an embedded server for the command's life.

With ``PREFECT_API_URL`` set (in the environment, a profile or a settings file) the command
reports to that server; otherwise it starts Prefect's ephemeral API server as a subprocess,
tied to its own life, and stops it cleanly, logs and events flushed, however the command ends.
Its runs land in Prefect's default database, so ``prefect server start`` shows them afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

from prefect_jax.training.names import PREFECT_UI_URL_ENV, PREFECT_UI_URL_LOCAL

# Prefect's server settings that, both false, skip block type registration at its start (and the
# import of every Prefect collection that deciding on it takes), and their older names: where a
# user set any of them, the embedded server keeps what they set.
BLOCK_REGISTRATION_SETTINGS = (
    "PREFECT_SERVER_REGISTER_BLOCKS_ON_START",
    "PREFECT_SERVER_MEMOIZE_BLOCK_AUTO_REGISTRATION",
)
BLOCK_REGISTRATION_ALIASES = (
    "PREFECT_API_BLOCKS_REGISTER_ON_START",
    "PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION",
)


@contextlib.contextmanager
def prefect_backend(server: EmbeddedServer | None = None) -> Iterator[str]:
    """Use the configured Prefect API, or run an embedded server for the duration of the block
    (`server`, when one was started early; see `early_server`)."""
    import prefect.settings
    from prefect.settings import PREFECT_API_URL

    configured = PREFECT_API_URL.value()
    if configured:
        if server is not None:  # a profile names a server after all
            server.stop()
        try:
            yield configured
        finally:
            drain_prefect_workers()
        return
    if server is None:
        # As SubprocessASGIServer: with the settings this process has (a profile, say).
        from prefect.settings import get_current_settings

        settings = get_current_settings().to_environment_variables(exclude_unset=True)
        server = EmbeddedServer(settings)
    try:
        # Prefect's own setting, at least 120 s: its default (20 s) is short for a first start on
        # a small machine.
        setting = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
        api_url = server.wait(timeout=max(120.0, float(setting or 0)))
        # Its runs are browsed later with `prefect server start` (same database): links point there.
        os.environ.setdefault(PREFECT_UI_URL_ENV, PREFECT_UI_URL_LOCAL)
        with prefect.settings.temporary_settings(updates={PREFECT_API_URL: api_url}):
            try:
                yield api_url
            finally:
                drain_prefect_workers()
    finally:
        server.stop()


def die_with_parent():
    """A ``preexec_fn`` for a child that must not outlive this command: on Linux it gets SIGTERM
    when this process dies, even by SIGKILL (PR_SET_PDEATHSIG), and does not start if this process
    died before that was set. libc is looked up here, so the forked child imports nothing (other
    threads may hold the import lock at the fork)."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except Exception:  # noqa: BLE001 - not Linux: the finally blocks still stop the server
        return None
    parent = os.getpid()

    def set_death_signal() -> None:  # pragma: no cover - runs in the forked child
        prctl(1, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return set_death_signal


def background_of_the_terminal():
    """A ``preexec_fn`` for a child run in its own process group (a background job of the
    terminal) that must not outlive this command (`die_with_parent`) and writes to the terminal:
    SIGTTOU ignored, so that under ``stty tostop`` its write (an error) goes through instead of
    stopping it while this command waits on it. An ignored signal stays ignored across the exec.
    (Ignored, it would not stop a change of the terminal's settings either: uvicorn makes none.)
    """
    import ctypes

    dies = die_with_parent()
    try:
        libc_signal = ctypes.CDLL("libc.so.6", use_errno=True).signal
    except Exception:  # noqa: BLE001 - not Linux: SIGTTOU keeps its default
        return dies

    def preexec() -> None:  # pragma: no cover - runs in the forked child
        libc_signal(signal.SIGTTOU, ctypes.c_void_p(1))  # (SIG_IGN)
        if dies is not None:
            dies()

    return preexec


def _prefect_package_dir() -> str:
    """Where the installed ``prefect`` package is, found without importing it (which is slow)."""
    import importlib.util

    return os.path.dirname(importlib.util.find_spec("prefect").origin)


class EmbeddedServer:
    """Prefect's ephemeral API server, run as `prefect.server.api.server.SubprocessASGIServer`
    runs it (uvicorn over ``prefect.server.api.server:create_app``, UI off, the same environment
    variables), tied to this process's life (`die_with_parent`).

    Unlike SubprocessASGIServer, it is started without importing Prefect's server modules in this
    process (FastAPI, the server's models), and it can be started before this process imports
    Prefect and the program, which its own start-up (seconds) then overlaps."""

    def __init__(self, settings_env: dict[str, str] | None = None):
        self.settings_env = settings_env or {}
        self.answered = False
        self.process = self._spawn()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _spawn(self):
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app_dir = os.path.dirname(_prefect_package_dir())  # Prefect's `__module_path__.parent`
        env = {
            **os.environ,
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            **self.settings_env,
        }
        named = BLOCK_REGISTRATION_SETTINGS + BLOCK_REGISTRATION_ALIASES
        profile = _profile_settings()
        if profile is not None and not any(name.upper() in named for name in (*env, *profile)):
            # Block types are not registered at its start: to find out whether they must be (even
            # memoized), Prefect imports every installed Prefect collection first, a large part
            # of its start. `prefect server start` registers them (the UI's blocks catalog), and
            # `Block.save` its own type.
            env.update(dict.fromkeys(BLOCK_REGISTRATION_SETTINGS, "false"))
        command = [
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",
            app_dir,
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ]
        # Its own process group: a terminal's Ctrl-C (SIGINT to the foreground group) stopped it
        # at once, while the command, checkpointing its step, went on recording to it and waited
        # out the client's retries. The command stops it as it ends (and its death signal).
        return subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,  # (a background job reading the terminal would be stopped)
            preexec_fn=background_of_the_terminal(),
            process_group=0,
        )

    def wait(self, timeout: float) -> str:
        """Wait until the server answers its health check; its API URL. Raises RuntimeError if it
        exits first (a port taken meanwhile: started again on another) or `timeout` runs out."""
        import time
        import urllib.request

        # Said once it is used (a command refused for bad input says only why).
        print(
            f"Starting temporary server on http://127.0.0.1:{self.port} (the command's own Prefect "
            "API: it stops with the command; its runs stay in its database, browsed with `prefect "
            "server start`)",
            file=sys.stderr,
        )
        # Loopback: never through a proxy.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline, respawns = time.monotonic() + timeout, 0
        while True:
            code = self.process.poll()
            if code == 3 and respawns < 3 and self._port_taken() and time.monotonic() < deadline:
                # uvicorn could not bind the port: taken by someone else since it was picked.
                respawns += 1
                self.process = self._spawn()
                again = f"http://127.0.0.1:{self.port}"
                print(
                    f"Port taken: starting the temporary server again on {again}", file=sys.stderr
                )
                continue
            if code is not None:
                raise RuntimeError(
                    f"the embedded Prefect server exited with code {code} before it answered (3: "
                    "its start-up failed, its database migration say): see its errors above, or "
                    "run `prefect server start` and set PREFECT_API_URL to use that one"
                )
            try:
                with opener.open(f"{self.api_url}/health", timeout=2) as response:
                    if response.status == 200:
                        self.answered = True
                        return self.api_url
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the embedded Prefect server did not answer at {self.api_url} within "
                    f"{timeout:.0f} s: run `prefect server start` and set PREFECT_API_URL to use "
                    "that one"
                )
            time.sleep(0.1)

    def _port_taken(self) -> bool:
        import socket

        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", self.port))
            except OSError:
                return True
        return False

    def stop(self) -> None:
        """SIGTERM; a server that answered gets 5 s to end before SIGKILL (as SubprocessASGIServer).
        One still starting is left to end by itself once its start-up is over: uvicorn finishes
        that first, and a SIGKILL part-way could leave Prefect's database half-migrated."""
        import subprocess

        if self.process.poll() is None:
            self.process.terminate()
            if not self.answered:
                return
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def api_url_may_be_set_elsewhere() -> bool:
    """Whether Prefect may find an API URL outside the environment: in the active profile
    (``prefect cloud login`` and ``prefect config set`` write it there), or in a ``prefect.toml``,
    ``.env`` or ``pyproject.toml`` ``[tool.prefect]`` of the working directory. Read without
    importing Prefect; True when unsure."""
    found = _profile_settings()
    return found is None or bool(found.get("PREFECT_API_URL"))


def _profile_settings() -> dict[str, Any] | None:
    """The settings of Prefect's active profile, found as Prefect finds them, read without importing
    Prefect; None where a ``prefect.toml``, ``.env`` or ``pyproject.toml`` ``[tool.prefect]`` of the
    working directory may set more, or where a file is unreadable."""
    import tomllib

    if os.path.exists("prefect.toml") or os.path.exists(".env"):
        return None
    try:
        if os.path.exists("pyproject.toml"):
            with open("pyproject.toml", "rb") as f:
                if "prefect" in tomllib.load(f).get("tool", {}):
                    return None

        def read(path: str) -> dict:
            with open(path, "rb") as f:
                return tomllib.load(f)

        # As Prefect's settings find the active profile (prefect/settings/sources.py,
        # _get_profiles_path and ProfileSettingsTomlLoader); the settings files that can move
        # profiles_path returned above.
        shipped = os.path.join(_prefect_package_dir(), "settings", "profiles.toml")
        default = os.path.join(os.path.expanduser("~"), ".prefect", "profiles.toml")
        if os.environ.get("PREFECT_PROFILES_PATH"):
            path = os.environ["PREFECT_PROFILES_PATH"]
        elif os.environ.get("PREFECT_HOME"):
            path = os.path.join(os.environ["PREFECT_HOME"], "profiles.toml")
        else:
            path = default if os.path.exists(default) else shipped
        data = read(path) if os.path.exists(path) else {}
        profiles = data.get("profiles", {})
        active = os.environ.get("PREFECT_PROFILE") or data.get("active")
        if not active or active not in profiles:
            # Prefect's default: the shipped file's active profile.
            shipped_data = read(shipped)
            profiles = shipped_data.get("profiles", {})
            active = shipped_data.get("active", "ephemeral")
        return {str(k).upper(): v for k, v in profiles.get(active, {}).items()}
    except Exception:  # noqa: BLE001 - unreadable: Prefect decides, later
        return None


def early_server() -> EmbeddedServer | None:
    """The embedded server of a command that will need one (no Prefect API URL set anywhere; process
    0 of its job), started now. Where a setting may name a server (`api_url_may_be_set_elsewhere`),
    none: `prefect_backend` starts one later if Prefect finds no URL after all."""
    from prefect_jax.training.facade import leads_from_env

    if os.environ.get("PREFECT_API_URL") or not leads_from_env() or api_url_may_be_set_elsewhere():
        return None
    return EmbeddedServer()


def drain_prefect_workers() -> None:
    """Send buffered logs and events to the server before it stops (no lost task-run events)."""
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain():
        for fn in (lambda: APILogWorker.instance().drain(), EventsWorker.drain_all):
            try:
                result = fn()
                if inspect.isawaitable(result):
                    await result
            except RuntimeError:
                pass  # the worker never started

    run_coro_as_sync(drain())


def send_prefect_events(timeout: float = 10.0) -> None:
    """Wait, up to `timeout` seconds, until the events this process emitted (a block's load) have
    reached the server, the worker left running (`drain_prefect_workers` stops the workers, for a
    server about to stop): a command that exits at once after has Prefect's exit drain print
    "Still processing items" above the command's last line."""
    import threading

    from prefect.events.worker import EventsWorker

    waiter = threading.Thread(target=EventsWorker.instance().wait_until_empty, daemon=True)
    waiter.start()
    waiter.join(timeout)
