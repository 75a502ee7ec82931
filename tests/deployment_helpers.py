"""A real Prefect server and a `serve` process, in subprocesses, for deployment tests.

`PrefectServerProcess` runs ``prefect server start`` on a free loopback port with its own
PREFECT_HOME; `ServeProcess` runs ``python tests/deployment_helpers.py serve``, which serves
the `train_and_evaluate` flow as the deployment ``train_and_evaluate/<name>``, or (with
``mode="serve-roles"``) ``... serve-roles``, which serves the trainer and evaluator roles as
the deployments ``train/trainer`` and ``evaluate/evaluator`` in one process. Both run in
their own process group, so a SIGKILL of the group takes every child with it (a preempted
machine), and both are always cleaned up by `stop()`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from process_helpers import wait_healthy

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEPLOYMENT = "rerun-test"
TRAINER = "train/trainer"  # the deployments of `serve_roles`
EVALUATOR = "evaluate/evaluator"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        GIT_PYTHON_REFRESH="quiet",
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
        PREFECT_JAX_MLFLOW_STRICT="1",
    )
    env.update(extra)
    return env


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class _GroupProcess:
    """A subprocess in its own session/process group, logging to a file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT):
        self.log = log
        self._log_file = open(log, "ab")
        self.proc = subprocess.Popen(
            args,
            env=env,
            cwd=cwd,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def children(self) -> list[int]:
        """Pids of the processes in this group other than the leader (e.g. flow-run processes)."""
        out = subprocess.run(["pgrep", "-g", str(self.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split() if int(p) != self.pid]

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the group, then SIGKILL whatever is left; never raises."""
        try:
            if self.alive():
                self.kill_group(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
            self.kill_group(signal.SIGKILL)  # stragglers of the group, the leader included
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        finally:
            self._log_file.close()

    def tail(self, chars: int = 4000) -> str:
        return _tail(self.log, chars)


class PrefectServerProcess(_GroupProcess):
    """``prefect server start`` on 127.0.0.1:<free port>, SQLite in its own PREFECT_HOME."""

    def __init__(self, home: Path, ui: bool = False, **extra_env: str):
        home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.ui_url = f"http://127.0.0.1:{self.port}"
        if ui:  # the UI, calling this server's API (not the default :4200)
            extra_env = {
                "PREFECT_UI_ENABLED": "true",
                "PREFECT_UI_API_URL": self.api_url,
                **extra_env,
            }
        env = _base_env(PREFECT_HOME=str(home), PREFECT_LOGGING_LEVEL="WARNING", **extra_env)
        args = [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        super().__init__(args, env, home / "server.log")

    def wait_healthy(self, timeout: float = 120.0) -> None:
        wait_healthy(f"{self.api_url}/health", self.proc, "prefect server", self.tail, timeout, 0.5)


class ServeProcess(_GroupProcess):
    """``train_and_evaluate.serve(name=DEPLOYMENT)`` against `api_url` (or, with
    ``mode="serve-roles"``, `serve_roles`); each flow run is a child process."""

    def __init__(self, api_url: str, home: Path, log: Path, mode: str = "serve", **extra_env: str):
        home.mkdir(parents=True, exist_ok=True)
        env = _base_env(
            PREFECT_HOME=str(home),
            PREFECT_API_URL=api_url,
            PREFECT_LOGGING_LEVEL="INFO",
            # pick up a scheduled (or retried) run within a second
            PREFECT_RUNNER_POLL_FREQUENCY="1",
            PYTHONPATH=os.pathsep.join(
                p for p in (str(HERE), str(ROOT), os.environ.get("PYTHONPATH")) if p
            ),
        )
        env.update(extra_env)
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: use one of {sorted(MODES)}")
        super().__init__([sys.executable, str(Path(__file__).resolve()), mode], env, log)


def trainer_on_process_worker(
    api_url: str,
    pool: str,
    name: str,
    params: dict,
    home: Path,
    log: Path,
    query_seconds: str,
    paths: list[str],
    job_variables: dict | None = None,
    automation: dict | None = None,
    **extra_env: str,
):
    """The README's deployment of the trainer: a ``process`` work pool `pool`, the `train` flow
    of this checkout deployed to it as ``train/<name>`` with `params` (and `job_variables`), the
    rerun automation for it (`create_rerun_automation`'s keyword arguments: `automation`), and
    ``prefect worker start --pool <pool>`` polling every `query_seconds` (PYTHONPATH: `paths`,
    then this checkout). The caller's Prefect settings name `api_url`. Returns the deployment id
    and the worker (stop it)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from prefect_jax.deployments.automations import create_rerun_automation
    from prefect_jax.flows import train

    with get_client(sync_client=True) as client:
        # (overwrite: a create the client sent again after losing its response finds the pool)
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"), overwrite=True)
    deployment_id = train.from_source(
        source=str(ROOT), entrypoint="prefect_jax/flows/__init__.py:train"
    ).deploy(
        name=name,
        work_pool_name=pool,
        parameters=params,
        job_variables=job_variables,
        build=False,
        push=False,
        print_next_steps=False,
    )
    create_rerun_automation(f"train/{name}", **(automation or {}))
    env = _base_env(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api_url,
        PREFECT_LOGGING_LEVEL="INFO",
        PREFECT_WORKER_QUERY_SECONDS=query_seconds,
        PYTHONPATH=os.pathsep.join([*paths, str(ROOT)]),
        **extra_env,
    )
    env = {k: v for k, v in env.items() if v is not None}
    return deployment_id, _GroupProcess(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool], env, log
    )


def serve(name: str = DEPLOYMENT) -> None:
    from prefect_jax.flows import train_and_evaluate

    train_and_evaluate.serve(name=name, limit=1, print_starting_message=False)


def serve_roles() -> None:
    """The trainer and the evaluator of a job as two deployments of one `serve` process
    (``train/trainer``, ``evaluate/evaluator``); room for a few runs at once."""
    from prefect import serve as serve_all

    from prefect_jax.flows import evaluate, train

    serve_all(
        train.to_deployment(name=TRAINER.split("/")[1]),
        evaluate.to_deployment(name=EVALUATOR.split("/")[1]),
        limit=4,
        print_starting_message=False,
    )


MODES = {"serve": serve, "serve-roles": serve_roles}


# -- shared by the deployment tests ----------------------------------------------------------


def dead(pid: int) -> bool:
    """Gone, or a zombie (a child whose parent has not reaped it yet)."""
    from prefect_jax.training.local_processes import process_alive

    return not process_alive(pid)


def start_deployment_run(name: str, parameters: dict):
    """A new flow run of the deployment `name` with `parameters`, not waited for: the one run
    ``run_deployment`` creates, however often its client sends the request. Prefect's client
    sends a POST again when its response is lost (a read timeout, 60 s, while the server waits
    on SQLite's write lock; a connection dropped after the commit), so the server may already
    have made the run; without an idempotency key that makes two flow runs of the job, and serve
    (limit 1) starts the one the test was not given. Keyed, the server answers a resent request
    with the run it made."""
    import uuid

    from prefect.deployments import run_deployment

    return run_deployment(
        name=name, parameters=parameters, timeout=0, idempotency_key=str(uuid.uuid4())
    )


def deployment_runs(client, flow_run_id) -> list[tuple[str, str, str]]:
    """(id, state, created) of every flow run of `flow_run_id`'s deployment, for assertion
    messages."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    deployment_id = client.read_flow_run(flow_run_id).deployment_id
    runs = client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
    )
    return [(str(r.id), r.state_name, str(r.created)) for r in runs]


def logs(*procs: _GroupProcess, chars: int = 6000) -> str:
    """The tails of the processes' logs, for assertion messages."""
    return "\n".join(f"--- {p.log.name} ---\n{p.tail(chars)}" for p in procs)


def wait_for_deployments(
    client, serve: ServeProcess, names: list[str], timeout: float = 120.0
) -> dict:
    """``{name: deployment}`` once `serve` has registered every deployment in `names`."""
    found: dict = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not serve.alive():
            raise AssertionError(f"serve exited early\n{logs(serve)}")
        for name in names:
            if name not in found:
                try:
                    found[name] = client.read_deployment_by_name(name)
                except Exception:  # noqa: BLE001 - not registered yet
                    pass
        if len(found) == len(names):
            return found
        time.sleep(0.5)
    raise AssertionError(
        f"deployments {sorted(set(names) - set(found))} not registered after {timeout:.0f}s\n"
        f"{logs(serve)}"
    )


def deployment_params(
    program: str,
    job: str,
    storage,
    mlflow_uri: str,
    max_steps: int,
    every: int,
    log_every: int = 50,
) -> dict:
    """A train_and_evaluate deployment run's parameters, JSON as a user would type them in the UI
    (`job_config` reads them back)."""
    return {
        "program": program,
        "job": job,
        "storage": str(storage),
        "train_spec": {"max_steps": max_steps, "log_every_steps": log_every},
        "checkpoint_spec": {"every_steps": every},
        "mlflow_tracking_uri": mlflow_uri,
    }


def job_config(params: dict):
    """The engine's JobConfig for a deployment run's JSON parameters."""
    from prefect_jax.training.specs import JobConfig

    return JobConfig(
        program=params["program"],
        job=params["job"],
        storage=params["storage"],
        train=params["train_spec"],
        checkpoint=params["checkpoint_spec"],
        mlflow_tracking_uri=params["mlflow_tracking_uri"],
    )


def uninterrupted_fingerprint(config) -> str:
    """Train the job from scratch to max_steps in this process with the engine, as the flow does."""
    from prefect_jax.training.trainer import Trainer

    trainer = Trainer(config)
    try:
        assert trainer.restore_or_init() == 0
        while trainer.step < config.train.max_steps:
            trainer.train_until_checkpoint()
        trainer.finish()
        return trainer.fingerprint()
    finally:
        trainer.close()


def checkpoint_fingerprint(config, step: int) -> tuple[str, dict]:
    """Fingerprint and metadata of one committed step of a job, read-only (no lease, no MLflow)."""
    import jax

    from prefect_jax.training.checkpoints import Checkpoints
    from prefect_jax.training.program import load_program
    from prefect_jax.training.storage import JobStorage
    from prefect_jax.training.trees import state_fingerprint

    program = load_program(config.program)
    abstract = jax.eval_shape(program.init, jax.random.key(config.train.seed))
    checkpoints = Checkpoints(JobStorage(config.storage, config.job).checkpoint_dir, read_only=True)
    try:
        state, meta = checkpoints.restore(step, abstract)
    finally:
        checkpoints.close()
    return state_fingerprint(state), meta


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] in MODES:
        MODES[sys.argv[1]]()
    else:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(MODES)}}}")


def until(what: str, check, timeout: float, worker: _GroupProcess, every: float = 0.05):
    """`check()`'s first truthy answer within `timeout` seconds, while `worker` (a worker or
    serve process) stays alive; an AssertionError with its log's tail otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        assert worker.alive(), f"the worker exited while waiting for {what}\n{worker.tail(8000)}"
        time.sleep(every)
    raise AssertionError(f"no {what} after {timeout:.0f}s\n{worker.tail(8000)}")
