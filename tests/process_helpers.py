"""Real `prefect-jax` processes for the kill tests: start one, wait for what it writes, signal
it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS_DIR = os.path.join(os.path.dirname(TESTS_DIR), "benchmarks")


def json_on_cpu_devices(script: str, devices: int, timeout: float = 300) -> dict:
    """Run `script` (Python source) in a fresh interpreter with `devices` CPU devices
    (``XLA_FLAGS``, read at JAX's start) and return the JSON of its last line of stdout."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def wait_healthy(
    url: str,
    proc: subprocess.Popen,
    what: str,
    log_tail: Callable[[], str],
    timeout: float,
    poll: float,
) -> None:
    """Poll `url` until it answers 200. Raises RuntimeError (with `log_tail()`) if `proc` ends
    first, TimeoutError once `timeout` seconds have passed."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    raise TimeoutError(f"{what} not healthy after {timeout:.0f}s:\n{log_tail()}")


def cli_env(api_url: str, **extra: str) -> dict[str, str]:
    """The environment of a child process reporting to the Prefect server at `api_url`."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(
        PREFECT_API_URL=api_url,
        PREFECT_LOGGING_LEVEL="INFO",
        PYTHONPATH=os.pathsep.join([TESTS_DIR, env.get("PYTHONPATH", "")]),
        **extra,
    )
    return env


def run_cli(
    *args: str,
    prefix: tuple[str, ...] = (),
    timeout: float = 600,
    unset: tuple[str, ...] = (),
    **extra_env: str,
) -> subprocess.CompletedProcess:
    """``python -m prefect_jax.cli ARGS`` run to its end, its output captured, with no Prefect
    server from this environment (the command starts its own unless `extra_env` names one);
    `prefix`: a command to run it under (``ulimit``, ``nice``); `unset`: environment variables
    it does not get."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL" and k not in unset}
    env.update(extra_env)
    return subprocess.run(
        [*prefix, sys.executable, "-m", "prefect_jax.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def job_args(program, job, storage, max_steps, every, mlflow_uri, *extra: str) -> list[str]:
    """The flags of a ``prefect-jax run`` of `job` as the tests start it: its program, storage,
    length and checkpoint cadence, MLflow store, and one ``--json`` summary line without a
    progress bar; then `extra` flags."""
    return [
        *("--program", program, "--job", job, "--storage", str(storage)),
        *("--max-steps", str(max_steps), "--checkpoint-every-steps", str(every)),
        *("--mlflow-tracking-uri", mlflow_uri, "--json", "--no-progress"),
        *extra,
    ]


def start_run(args: list[str], api_url: str, log_path, **extra_env: str) -> subprocess.Popen:
    """``python -m prefect_jax.cli run ARGS`` with its output in `log_path`."""
    log = open(log_path, "w")
    return subprocess.Popen(
        [sys.executable, "-m", "prefect_jax.cli", "run", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=cli_env(api_url, **extra_env),
        cwd=TESTS_DIR,
    )


def wait_until(
    predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, poll: float = 0.002
):
    """Poll `predicate` until it is true; fail naming `what` on timeout or if `proc` ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended (rc={proc.returncode}) before {what}")
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def task_runs(client, flow_run_id) -> list:
    """A flow run's task runs, read once with a sync Prefect client, in the order they were due."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    return client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
        sort=TaskRunSort.EXPECTED_START_TIME_ASC,
        limit=200,
    )


def settled_task_runs(
    flow_run_id,
    *expect: str,
    client=None,
    every_run_final: bool = True,
    settle_secs: float = 30.0,
) -> list:
    """A flow run's task runs once those named `expect` are there and final, and, with
    `every_run_final`, every other one too; what was last read after `settle_secs`, for the
    test's own assertions to name. Task run states reach the server as events, which the flow
    engine does not wait for when the flow run ends: a read right after it may find the last
    one still Running, or not there yet. `client`: a sync Prefect client (default: a new one)."""
    if client is None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return settled_task_runs(
                flow_run_id,
                *expect,
                client=client,
                every_run_final=every_run_final,
                settle_secs=settle_secs,
            )
    deadline = time.monotonic() + settle_secs
    while True:
        runs = task_runs(client, flow_run_id)
        final = {r.name for r in runs if r.state is not None and r.state.is_final()}
        settled = set(expect) <= final and (
            not every_run_final or all(r.state is not None and r.state.is_final() for r in runs)
        )
        if settled or time.monotonic() > deadline:
            return runs
        time.sleep(0.25)


def orbax_tmp_dirs(checkpoint_dir: str, step: int | None = None) -> list[str]:
    """Temporary directories of saves in flight (of `step`, or of any step)."""
    prefix = f"{step}.orbax-checkpoint-tmp" if step is not None else ""
    try:
        return [
            n
            for n in os.listdir(checkpoint_dir)
            if ".orbax-checkpoint-tmp" in n and n.startswith(prefix)
        ]
    except FileNotFoundError:
        return []


def status(job: str, storage: str, env: dict | None = None) -> dict:
    """``prefect-jax status --json`` of a job (in `env`, default this process's environment)."""
    import json

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect_jax.cli",
            "status",
            "--job",
            job,
            "--storage",
            storage,
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=TESTS_DIR,
    ).stdout
    return json.loads(out.splitlines()[-1])


def job_events(api_url, job, storage, prefix="prefect-jax.", expect=1, timeout=30):
    """prefect-jax events about a job (its resource id: storage + job), read over the REST API
    (events arrive asynchronously)."""
    import httpx

    from prefect_jax.deployments import job_resource_id

    deadline = time.monotonic() + timeout
    while True:
        body = {
            "filter": {
                "event": {"prefix": [prefix]},
                "any_resource": {"id": [job_resource_id(job, storage)]},
            },
            "limit": 50,
        }
        response = httpx.post(f"{api_url}/events/filter", json=body, timeout=30)
        assert response.status_code == 200, response.text
        events = response.json()["events"]
        if len(events) >= expect or time.monotonic() > deadline:
            return events
        time.sleep(0.5)
