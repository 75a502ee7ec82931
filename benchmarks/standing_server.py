"""`prefect server start` on loopback with a PREFECT_HOME of its own (SQLite), as a team runs
one: the server that `run.py`'s sides and the other benchmarks (`goodput.py`, `server_cost.py`,
`server_apart.py`, `s3_rerun.py`, ...) train against."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandingServer:
    """`prefect server start` on loopback with its own PREFECT_HOME (SQLite), as a team runs one."""

    def __init__(self, home: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.env = dict(
            os.environ,
            PREFECT_HOME=home,
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_UI_ENABLED="false",
        )
        self.env.pop("PREFECT_API_URL", None)
        self.proc = None

    def __enter__(self):
        t = time.perf_counter()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefect",
                "server",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        self.start_s = time.perf_counter() - t
                        self.settle()
                        return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("prefect server did not start within 180 s")

    def cpu_s(self) -> float:
        """CPU seconds the server's processes have used so far (it shares this
        machine's cores with the sides)."""
        import psutil

        try:
            procs = [
                psutil.Process(self.proc.pid),
                *psutil.Process(self.proc.pid).children(recursive=True),
            ]
        except psutil.Error:
            return 0.0
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def settle(self, limit_s: float = 60.0) -> None:
        """Wait until the server is idle (its processes below 10% of a CPU over a second), at most
        `limit_s`: it goes on migrating its database and starting its services after it answers
        (which must not land on the first side measured), and on recording a flow run's events
        after the run ends. Sets `settled` (idle within the limit) and `settle_s` (the wait)."""
        import psutil

        t = time.perf_counter()
        procs = [psutil.Process(self.proc.pid)]
        while time.perf_counter() - t < limit_s:
            procs = [
                psutil.Process(self.proc.pid),
                *psutil.Process(self.proc.pid).children(recursive=True),
            ]
            for p in procs:
                p.cpu_percent(None)
            time.sleep(1.0)
            busy = sum(p.cpu_percent(None) for p in procs if p.is_running())
            if busy < 10.0:
                self.settled = True
                break
        else:
            self.settled = False
        self.settle_s = time.perf_counter() - t

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
