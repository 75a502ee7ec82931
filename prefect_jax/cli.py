"""The ``prefect-jax`` command: ``demo``, ``run``, the roles ``train``, ``evaluate`` and
``export``, ``status`` and ``automations``.

``demo`` and ``run`` execute the `train_and_evaluate` flow in this process; ``train``,
``evaluate`` and ``export`` the flows of TensorFlow's chief and evaluator roles. With
``PREFECT_API_URL`` set they report to that server; otherwise they start an embedded
Prefect server for the duration of the command (the runs land in Prefect's default
database, so ``prefect server start`` shows them afterwards) and stop it cleanly, logs
and events flushed, however the command ends.

With ``--json`` the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
from typing import Any, Iterator

DEMO_PROGRAM = "prefect_jax.examples.digits:program"
DEMO_JOB = "digits"


def _quiet_env() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")


@contextlib.contextmanager
def prefect_backend(server: _EmbeddedServer | None = None) -> Iterator[str]:
    """Use the configured Prefect API, or run an embedded server for the duration of the block
    (`server`, when one was started early; see `_early_server`)."""
    import prefect.settings
    from prefect.settings import PREFECT_API_URL

    configured = PREFECT_API_URL.value()
    if configured:
        if server is not None:  # a profile names a server after all
            server.stop()
        try:
            yield configured
        finally:
            _drain_prefect_workers()
        return
    if server is None:  # as SubprocessASGIServer: with the settings this process has (a profile, say)
        from prefect.settings import get_current_settings

        server = _EmbeddedServer(get_current_settings().to_environment_variables(exclude_unset=True))
    try:
        # Prefect's own setting, at least 120 s: its default (20 s) is short for a first start on 2 CPUs.
        timeout = max(120.0, float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") or 0))
        api_url = server.wait(timeout=timeout)
        # Its runs are browsed later with `prefect server start` (same database): links point there.
        os.environ.setdefault("PREFECT_JAX_PREFECT_UI_URL", "http://127.0.0.1:4200")
        with prefect.settings.temporary_settings(updates={PREFECT_API_URL: api_url}):
            try:
                yield api_url
            finally:
                _drain_prefect_workers()
    finally:
        server.stop()


def _die_with_parent():
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


def _prefect_package_dir() -> str:
    """Where the installed ``prefect`` package is, found without importing it (~1.2 s)."""
    import importlib.util

    return os.path.dirname(importlib.util.find_spec("prefect").origin)


# Prefect's server settings that, both false, skip block type registration at its start (and the
# import of every Prefect collection that deciding on it takes), and their older names: where a
# user set any of them, the embedded server keeps what they set.
_BLOCK_REGISTRATION_SETTINGS = ("PREFECT_SERVER_REGISTER_BLOCKS_ON_START", "PREFECT_SERVER_MEMOIZE_BLOCK_AUTO_REGISTRATION")
_BLOCK_REGISTRATION_ALIASES = ("PREFECT_API_BLOCKS_REGISTER_ON_START", "PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION")


class _EmbeddedServer:
    """Prefect's ephemeral API server, run as `prefect.server.api.server.SubprocessASGIServer`
    runs it (uvicorn over ``prefect.server.api.server:create_app``, UI off, the same environment
    variables), tied to this process's life (`_die_with_parent`).

    Unlike SubprocessASGIServer, it is started without importing Prefect's server modules in this
    process (FastAPI, the server's models: ~2 s of CPU), and it can be started before this process
    imports Prefect and the program, which its own start-up (seconds) then overlaps."""

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
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
               **self.settings_env}  # fmt: skip
        named = _BLOCK_REGISTRATION_SETTINGS + _BLOCK_REGISTRATION_ALIASES
        profile = _profile_settings()
        if profile is not None and not any(name.upper() in named for name in (*env, *profile)):
            # Block types are not registered at its start: to find out whether they must be (even
            # memoized), Prefect imports every installed Prefect collection first (with the dev
            # group's prefect-kubernetes and prefect-gcp, 1.5 s of a 4.7 s start). `prefect server
            # start` registers them (the UI's blocks catalog), and `Block.save` its own type.
            env.update(dict.fromkeys(_BLOCK_REGISTRATION_SETTINGS, "false"))
        return subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", app_dir, "--factory", "prefect.server.api.server:create_app",
             "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
            env=env, preexec_fn=_die_with_parent(),
        )  # fmt: skip

    def wait(self, timeout: float) -> str:
        """Wait until the server answers its health check; its API URL. Raises RuntimeError if it
        exits first (a port taken meanwhile: started again on another) or `timeout` runs out."""
        import time
        import urllib.request

        # Said once it is used (a command refused for bad input says only why).
        print(f"Starting temporary server on http://127.0.0.1:{self.port} (the command's own Prefect API: it stops with "
              "the command; its runs stay in its database, browsed with `prefect server start`)", file=sys.stderr)  # fmt: skip
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
        deadline, respawns = time.monotonic() + timeout, 0
        while True:
            code = self.process.poll()
            if code == 3 and respawns < 3 and self._port_taken() and time.monotonic() < deadline:
                respawns += 1  # uvicorn could not bind the port: taken by someone else since it was picked
                self.process = self._spawn()
                print(f"Port taken: starting the temporary server again on http://127.0.0.1:{self.port}", file=sys.stderr)
                continue
            if code is not None:
                raise RuntimeError(
                    f"the embedded Prefect server exited with code {code} before it answered (3: its start-up failed, "
                    "its database migration say): see its errors above, or run `prefect server start` and set "
                    "PREFECT_API_URL to use that one"
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
                    f"the embedded Prefect server did not answer at {self.api_url} within {timeout:.0f} s: "
                    "run `prefect server start` and set PREFECT_API_URL to use that one"
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


def _api_url_may_be_set_elsewhere() -> bool:
    """Whether Prefect may find an API URL outside the environment: in the active profile
    (``prefect cloud login`` and ``prefect config set`` write it there), or in a ``prefect.toml``,
    ``.env`` or ``pyproject.toml`` ``[tool.prefect]`` of the working directory. Read without
    importing Prefect (~1.2 s); True when unsure."""
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

        # As Prefect's settings find the active profile (prefect/settings/sources.py, _get_profiles_path
        # and ProfileSettingsTomlLoader); the settings files that can move profiles_path returned above.
        shipped = os.path.join(_prefect_package_dir(), "settings", "profiles.toml")
        default = os.path.join(os.path.expanduser("~"), ".prefect", "profiles.toml")
        path = os.environ.get("PREFECT_PROFILES_PATH") or (
            os.path.join(os.environ["PREFECT_HOME"], "profiles.toml") if os.environ.get("PREFECT_HOME")
            else default if os.path.exists(default) else shipped
        )  # fmt: skip
        data = read(path) if os.path.exists(path) else {}
        profiles, active = data.get("profiles", {}), os.environ.get("PREFECT_PROFILE") or data.get("active")
        if not active or active not in profiles:  # Prefect's default: the shipped file's active profile
            shipped_data = read(shipped)
            profiles, active = shipped_data.get("profiles", {}), shipped_data.get("active", "ephemeral")
        return {str(k).upper(): v for k, v in profiles.get(active, {}).items()}
    except Exception:  # noqa: BLE001 - unreadable: Prefect decides, later
        return None


def _early_server() -> _EmbeddedServer | None:
    """The embedded server of a command that will need one (no Prefect API URL set anywhere; process
    0 of its job), started now. Where a setting may name a server (`_api_url_may_be_set_elsewhere`),
    none: `prefect_backend` starts one later if Prefect finds no URL after all."""
    from prefect_jax.training.cluster import leads_from_env

    if os.environ.get("PREFECT_API_URL") or not leads_from_env() or _api_url_may_be_set_elsewhere():
        return None
    return _EmbeddedServer()


def _exit_on_sigterm(signum, frame):
    """SIGTERM ends the command through its finally blocks (the embedded server stops, logs flush).

    During a flow run Prefect's own handler takes over and, once the run is marked Crashed,
    hands the signal back here.
    """
    from prefect_jax.training import preemption

    preemption.note_received(signum)  # (an import it breaks may fail otherwise: `main` still says why)
    raise SystemExit(128 + signum)


def _drain_prefect_workers() -> None:
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


@contextlib.contextmanager
def _logs_above(console) -> Iterator[None]:
    """Log lines printed above a live progress bar, not glued onto it: Prefect's console handlers
    print through the bar's console, other stderr handlers write through rich's redirected stderr."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    swapped: list[tuple[logging.Handler, str, Any]] = []
    for handler in {h for lg in loggers for h in lg.handlers}:
        if isinstance(handler, PrefectConsoleHandler):
            swapped.append((handler, "console", handler.console))
            handler.console = console
        elif isinstance(handler, logging.StreamHandler) and handler.stream in (sys.__stderr__, sys.__stdout__):
            swapped.append((handler, "stream", handler.stream))
            handler.setStream(sys.stderr)  # rich's proxy while the bar is live
    try:
        yield
    finally:
        for handler, attr, old in swapped:
            if attr == "console":
                handler.console = old
            else:
                handler.setStream(old)


@contextlib.contextmanager
def progress_bar(enabled: bool, max_steps: int) -> Iterator[None]:
    """A live progress bar on stderr while training runs in this process."""
    if not enabled:
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from prefect_jax.training.loop import add_progress_listener

    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[metrics]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress, _logs_above(progress.console):
        # Until the first step is known: starting Prefect, restoring, compiling.
        task_id = progress.add_task("starting", total=max_steps, metrics="(Prefect, restore, compile)")

        def update(step: int, max_steps: int, metrics: dict) -> None:
            text = " ".join(f"{k}={float(v):.4f}" for k, v in sorted(metrics.items()))
            progress.update(task_id, description="training", completed=step, total=max_steps, metrics=text)

        remove = add_progress_listener(update)
        try:
            yield
        finally:
            remove()


def _emit(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, sort_keys=True, default=str))
        return
    for key, value in summary.items():
        if key == "browse":
            continue
        if key == "goodput":
            from prefect_jax.training.goodput import describe

            value = describe(value)
        print(f"{key:>20}: {value}")
    for line in summary.get("browse", []):
        print(line)


def _specs(args: argparse.Namespace):
    """TrainSpec, EvalSpec and CheckpointSpec from the command line."""
    from prefect_jax.training.specs import BestExporter, CheckpointSpec, EvalSpec, FinalExporter, LatestExporter, TrainSpec

    train_spec = TrainSpec(
        max_steps=args.max_steps,
        seed=args.seed,
        log_every_steps=args.log_every_steps,
        steps_per_dispatch=args.steps_per_dispatch,
        sigterm_grace_secs=args.sigterm_grace_secs,
        lease_timeout_secs=args.lease_timeout_secs,
    )
    checkpoint_spec = CheckpointSpec(
        every_steps=args.checkpoint_every_steps,
        every_secs=args.checkpoint_every_secs,
        keep_last=args.keep_last,
        keep_every_steps=args.keep_every_steps,
        backups=args.backups,
    )
    exporters = []
    for name in args.exporters:
        if name == "latest":
            exporters.append(LatestExporter())
        elif name == "best":
            exporters.append(BestExporter(metric=args.best_metric, mode=args.best_mode))
        elif name == "final":
            exporters.append(FinalExporter())
    eval_spec = EvalSpec(
        steps=args.eval_steps, name=args.eval_name, throttle_secs=args.throttle_secs, exporters=exporters,
        registered_model=args.registered_model, export_platforms=args.export_platforms,
    )  # fmt: skip
    return train_spec, eval_spec, checkpoint_spec


def _run_flow(
    args: argparse.Namespace, program: str, job: str, storage: str, tracking_uri: str, role: str = "train_and_evaluate"
) -> dict[str, Any]:
    """Run the flow of `role` in this process (progress bar for the roles that train)."""
    collecting = gc.isenabled()
    gc.disable()  # through the start-up's imports, until `_freeze_startup_objects` (which says why)
    try:
        from prefect_jax.training.tracking import warm_up

        # MLflow's import, in its worker process, beside the imports below (and, where this
        # process will register exports, what logging a model needs: JAX on the worker's CPU).
        registers = role in ("train_and_evaluate", "evaluate") and bool(args.exporters) and args.registered_model != ""
        warm_up(tracking_uri, registry=registers)
        train_spec, eval_spec, checkpoint_spec = _specs(args)  # bad values: refused before anything starts
        server = _early_server()  # the embedded Prefect server's start-up, beside the imports below too
        try:
            return _run_flow_with(args, program, job, storage, tracking_uri, role, (train_spec, eval_spec, checkpoint_spec), server)
        finally:
            if server is not None:  # stopped already unless something failed before it was used
                server.stop()
    finally:
        if collecting:
            gc.enable()  # a run refused or failed before its freeze; a caller's choice otherwise kept


def _run_flow_with(args, program, job, storage, tracking_uri, role, specs, server) -> dict[str, Any]:
    from prefect_jax import flows

    train_spec, eval_spec, checkpoint_spec = specs
    common = dict(
        program=program, job=job, storage=storage, train_spec=train_spec, eval_spec=eval_spec,
        checkpoint_spec=checkpoint_spec, mlflow_tracking_uri=tracking_uri, mlflow_experiment=args.mlflow_experiment,
    )  # fmt: skip
    if role in ("train_and_evaluate", "train"):
        flow = flows.train_and_evaluate if role == "train_and_evaluate" else flows.train
        kwargs = dict(common, checkpoint_path=args.checkpoint_path, compilation_cache_dir=args.compilation_cache)
    elif role == "evaluate":
        flow, kwargs = flows.evaluate, dict(
            common, compilation_cache_dir=args.compilation_cache, every_checkpoint=not args.newest_only, once=args.once,
            wait_for_first_checkpoint_secs=args.wait_for_first_checkpoint_secs, poll_secs=args.poll_secs,
            idle_timeout_secs=args.idle_timeout_secs,
        )  # fmt: skip
    else:
        flow, kwargs = flows.export_flow, dict(common, step=args.step)
    from prefect_jax.blocks import BLOCK_PREFIX

    check = (program, job, storage, args.max_steps if role in ("train_and_evaluate", "train") else None)
    if not storage.startswith(BLOCK_PREFIX):
        _preflight(*check)  # refused in a fraction of a second (a server started early is stopped unused)
    from prefect_jax.training import cluster

    if role in ("train_and_evaluate", "train") and cluster.initialize() is not None and cluster.process_index() > 0:
        with prefect_backend(server):  # process 1+ of several: a child flow run of process 0's
            _freeze_startup_objects()
            return flows.run_as_process(flow=flow, parameters=kwargs)
    with prefect_backend(server):
        if storage.startswith(BLOCK_PREFIX):
            _preflight(*check)  # the block is read from the server
        import prefect

        from prefect_jax.tasks import process_tag

        # Tagged from its creation: a run killed before its first task is still found by the
        # job, and the process tag lets the next run prove it dead (see mark_dead_local_runs).
        tags = prefect.tags("prefect-jax", f"job:{job}", process_tag())
        with tags, progress_bar(not args.no_progress and role in ("train_and_evaluate", "train"), args.max_steps):
            _freeze_startup_objects()
            return flow(**kwargs)


def _freeze_startup_objects() -> None:
    """Move what the imports made (Prefect, JAX, Orbax, the program: over a million objects) out
    of the garbage collector's reach and turn it on (`prefect_jax.startup`, which says why).

    The collector was off until now (`_run_flow`, for the commands that train, evaluate or export):
    during the imports its passes walked the growing heap again and again, ~0.4 s of a 2 s
    start-up on 2 CPUs (2026-11-25: the goodput job's imports 2.13 s with it, 1.76 s without)."""
    from prefect_jax.startup import freeze_startup_objects

    freeze_startup_objects()


def _preflight(program: str, job: str, storage: str, max_steps: int | None) -> None:
    """Refuse what the flow would refuse, before it starts: one clear error line, and no failed
    flow run with a traceback in front of it. The flow checks the same things again (a
    deployment's runs do not come through here)."""
    from prefect_jax.blocks import resolve_storage
    from prefect_jax.training.errors import PastMaxStepsError
    from prefect_jax.training.program import load_program
    from prefect_jax.training.redaction import redact_url
    from prefect_jax.training.remote import job_committed_steps
    from prefect_jax.training.storage import JobStorage
    from prefect_jax.tasks import ui_refresh_secs

    ui_refresh_secs()
    load_program(program)
    url, options = resolve_storage(storage)
    js = JobStorage(url, job, options)
    js.check_writable()
    committed = job_committed_steps(js) if max_steps is not None else []
    if committed and committed[-1] > max_steps:
        raise PastMaxStepsError(redact_url(js.job_dir), committed[-1], max_steps)


def _browse_lines(summary: dict[str, Any]) -> list[str]:
    uri = summary["mlflow_tracking_uri"]
    run_url = summary.get("mlflow_run_url") or "http://127.0.0.1:5000"
    lines = ["", "Browse the results:", f"  MLflow:  uv run mlflow ui --backend-store-uri {uri}   (then open {run_url})"]
    if summary.get("registered_model"):
        lines.append(f"  Serve:   mlflow.pyfunc.load_model('models:/{summary['registered_model']}@best')   (with MLFLOW_TRACKING_URI={uri})")
    if not os.environ.get("PREFECT_API_URL") or os.environ.get("PREFECT_JAX_EMBEDDED_API"):  # (the launcher's embedded server)
        lines.append("  Prefect: uv run prefect server start   (then open http://127.0.0.1:4200)")
    lines.append(f"  Status:  uv run prefect-jax status --job {summary['job']} --storage {summary['storage']}")
    return lines


def cmd_demo(args: argparse.Namespace) -> int:
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    storage = os.path.join(workdir, "storage")
    tracking_uri = args.mlflow_tracking_uri or f"sqlite:///{os.path.join(workdir, 'mlflow.db')}"
    summary = _run_flow(args, DEMO_PROGRAM, DEMO_JOB, storage, tracking_uri)
    summary["storage"] = storage
    summary["browse"] = _browse_lines(summary)
    _emit(summary, args.json)
    return 0


def _process_envs(n: int, coordinator: str, api_url: str, embedded: bool, environ: dict | None = None) -> list[dict[str, str]]:
    """The environments of ``--processes N``'s processes: the cluster (``PREFECT_JAX_*``), one
    Prefect API, and each process's share of this machine's GPUs (`_gpu_envs`)."""
    environ = dict(os.environ if environ is None else environ)
    envs = []
    for k, gpus in enumerate(_gpu_envs(n, environ)):
        env = dict(environ, PREFECT_API_URL=api_url, PREFECT_JAX_NUM_PROCESSES=str(n), PREFECT_JAX_PROCESS_ID=str(k),
                   PREFECT_JAX_COORDINATOR_ADDRESS=coordinator, **gpus)  # fmt: skip
        if embedded:
            env["PREFECT_JAX_EMBEDDED_API"] = "1"
        envs.append(env)
    return envs


def _visible_gpus(environ: dict[str, str]) -> int:
    """How many NVIDIA GPUs a process started with `environ` sees: ``CUDA_VISIBLE_DEVICES`` (CUDA
    stops at its first entry that is no index, ``GPU-`` or ``MIG-`` UUID), else ``nvidia-smi -L``."""
    import subprocess

    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            entry = entry.strip()
            if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
                break
            count += 1
        return count
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, env=environ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


def _gpu_envs(n: int, environ: dict[str, str]) -> list[dict[str, str]]:
    """What each of `n` processes on this machine needs to share its NVIDIA GPUs: its own, as
    JAX's ``JAX_LOCAL_DEVICE_IDS`` (`jax.distributed.initialize` reads it), ``{"JAX_LOCAL_DEVICE_IDS":
    "0,1,2,3"}`` and ``"4,5,6,7"`` for 2 processes on 8 GPUs. Without it every process opens every
    GPU (JAX splits them by itself only under SLURM or Open MPI), each client taking 75% of every
    GPU's memory. Fewer GPUs than processes: they share them, without preallocation.

    Nothing: no NVIDIA GPU here (or ``JAX_PLATFORMS`` names none), or ``JAX_LOCAL_DEVICE_IDS``
    set already."""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if environ.get("JAX_LOCAL_DEVICE_IDS") or (platforms and not any(p in platforms for p in ("cuda", "gpu"))):
        return [{} for _ in range(n)]
    count = _visible_gpus(environ)
    if count == 0:
        return [{} for _ in range(n)]
    if count < n:
        print(f"prefect-jax: {n} processes share {count} GPU(s): each opens all of them, without preallocating "
              "their memory (XLA_PYTHON_CLIENT_PREALLOCATE=false)", file=sys.stderr)  # fmt: skip
        return [{"XLA_PYTHON_CLIENT_PREALLOCATE": environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "false")} for _ in range(n)]
    per = count // n
    if count % n:
        print(f"prefect-jax: {n} processes on {count} GPUs: {per} each, GPUs {per * n}-{count - 1} idle; run a number "
              f"of processes that divides {count} to use them all", file=sys.stderr)  # fmt: skip
    return [{"JAX_LOCAL_DEVICE_IDS": ",".join(str(i) for i in range(k * per, (k + 1) * per))} for k in range(n)]


def _launch_processes(args: argparse.Namespace) -> int:
    """``--processes N``: this command N times on this machine, as the N JAX processes of one job
    (``PREFECT_JAX_*`` set for each; process 0 runs the flow run, the others its children), all
    on one Prefect API (the embedded server, if none is configured). SIGTERM and SIGINT go to
    every process; when one ends with an error, the others are asked to stop (SIGTERM), then
    killed after the grace period. Exit code: the first failure's, else 0. Only process 0
    prints the summary."""
    import socket
    import subprocess
    import time

    argv, n = list(args.argv), args.processes
    for i, a in enumerate(argv):  # this command again, without --processes
        if a == "--processes":
            del argv[i : i + 2]
            break
        if a.startswith("--processes="):
            del argv[i]
            break
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    from prefect.settings import PREFECT_API_URL

    embedded = not PREFECT_API_URL.value()  # as prefect_backend decides
    with prefect_backend() as api_url:
        procs: list[subprocess.Popen] = []
        for k, env in enumerate(_process_envs(n, f"127.0.0.1:{port}", api_url, embedded)):
            extra = [] if k == 0 else ["--no-progress"]
            # Their own sessions: a Ctrl-C or SIGTERM reaches each once, forwarded from here.
            procs.append(subprocess.Popen([sys.executable, "-m", "prefect_jax.cli", *argv, *extra], env=env,
                                          stdout=None if k == 0 else subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=_die_with_parent()))  # fmt: skip
        signalled: list[int] = []

        def forward(signum, frame):
            if frame is not None:  # a signal to this launcher: the children's exits that follow are no failure of theirs
                signalled.append(signum)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            failed: int | None = None
            deadline = None
            while any(p.poll() is None for p in procs):
                for k, p in enumerate(procs):
                    if p.returncode not in (None, 0) and failed is None and not signalled:
                        failed = p.returncode
                        print(f"prefect-jax: process {k} of {n} ended with {p.returncode}: stopping the others", file=sys.stderr)
                        forward(signal.SIGTERM, None)
                        deadline = time.monotonic() + args.sigterm_grace_secs + 10
                if deadline is not None and time.monotonic() > deadline:
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                time.sleep(0.2)
            codes = [p.returncode for p in procs]
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if failed is None:
        failed = next((c for c in codes if c != 0), 0)
    return 128 - failed if failed < 0 else failed  # a child killed by signal S: 128 + S, as a shell says


def cmd_run(args: argparse.Namespace) -> int:
    """``run`` (train_and_evaluate), and the roles ``train``, ``evaluate``, ``export``."""
    from prefect_jax.training.tracking import default_tracking_uri

    if getattr(args, "processes", 1) < 1:
        raise ValueError(f"--processes {args.processes}: the number of JAX processes must be 1 or more")
    if getattr(args, "processes", 1) > 1:
        return _launch_processes(args)
    tracking_uri = args.mlflow_tracking_uri or default_tracking_uri()
    role = {"run": "train_and_evaluate"}.get(args.command, args.command)
    summary = _run_flow(args, args.program, args.job, args.storage, tracking_uri, role)
    if role == "export":
        summary = {"job": args.job, "exports": summary}
    summary["storage"] = args.storage
    if role in ("train_and_evaluate", "train"):
        summary["browse"] = _browse_lines(summary)
    _emit(summary, args.json)
    return 0


def job_status(job: str, storage: str) -> dict[str, Any]:
    """Committed steps, evaluated steps per eval name, and exports of a job."""
    from prefect_jax.training.storage import JobStorage

    from prefect_jax.blocks import resolve_storage
    from prefect_jax.training.remote import job_committed_steps

    url, options = resolve_storage(storage)
    js = JobStorage(url, job, options)
    if not js.fs.exists(js.job_dir):
        from prefect_jax.training.redaction import redact_url

        try:
            jobs = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in js.fs.ls(js.root, detail=False) if js.fs.isdir(p))
        except FileNotFoundError:
            jobs = []
        there = f"jobs there: {', '.join(jobs)}" if jobs else "no job there at all"
        raise FileNotFoundError(f"no job {job!r} in storage {redact_url(js.root)} ({there}); check --job and --storage")
    committed = job_committed_steps(js)
    evals_dir = js.path("evals")
    try:
        names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in js.fs.ls(evals_dir, detail=False))
    except FileNotFoundError:
        names = []
    from prefect_jax.training.exporters import list_exports

    from prefect_jax.deployments import job_resource_id

    status = {
        "job": job,
        "storage": js.root,
        "event_resource_id": job_resource_id(job, url),
        "committed_steps": committed,
        "evaluated_steps": {n: js.list_int_names(js.eval_dir(n)) for n in names},
        "exports": list_exports(js),
    }
    from prefect_jax.training.goodput import read_ledger, summarize

    status["goodput"] = summarize(read_ledger(js))
    recorded = js.read_json(js.path("registry.json"))
    if recorded:
        status["registered_model"] = _registry_status(recorded, js.job_dir)
    return status


def _registry_status(recorded: dict, job_key: str) -> dict[str, Any]:
    """The job's versions and aliases in the MLflow Model Registry, read from MLflow (the copy the
    job last recorded in its storage if MLflow cannot be reached)."""
    from prefect_jax.training.redaction import redact_url

    name, uri = recorded["name"], recorded["tracking_uri"]
    out = {"name": name, "tracking_uri": redact_url(uri), "versions": recorded["versions"], "aliases": recorded["aliases"]}
    try:
        from mlflow.tracking import MlflowClient

        from prefect_jax.training.registry import job_versions

        client = MlflowClient(uri)
        versions = job_versions(client, name, job_key)
        mine = {str(v.version) for v in versions.values()}
        aliases = {a: str(v) for a, v in (client.get_registered_model(name).aliases or {}).items() if str(v) in mine}
        out.update(versions={str(s): str(v.version) for s, v in sorted(versions.items())}, aliases=dict(sorted(aliases.items())))
    except Exception as exc:  # noqa: BLE001 - status still shows what the job recorded
        out["note"] = f"MLflow not reachable ({type(exc).__name__}): as last recorded by the job"
    return out


def cmd_status(args: argparse.Namespace) -> int:
    status = job_status(args.job, args.storage)
    if args.json:
        print(json.dumps(status, sort_keys=True))
    else:
        print(f"job {status['job']} in {status['storage']}")
        print(f"  event resource id: {status['event_resource_id']}  (a deployment trigger's match)")
        print(f"  committed steps: {status['committed_steps'] or 'none'}")
        for name, steps in status["evaluated_steps"].items() or [("eval", [])]:
            print(f"  evaluated ({name}): {steps or 'none'}")
        for name, steps in status["exports"].items():
            print(f"  exports ({name}): {steps}")
        from prefect_jax.training.goodput import describe

        print(f"  goodput: {describe(status['goodput'])}")
        registry = status.get("registered_model")
        if registry:
            versions = ", ".join(f"v{v} (step {s})" for s, v in registry["versions"].items()) or "none"
            aliases = ", ".join(f"@{a} = v{v}" for a, v in registry["aliases"].items()) or "none"
            print(f"  registered model {registry['name']} ({registry['tracking_uri']}): {versions}; aliases {aliases}")
            if registry.get("note"):
                print(f"    {registry['note']}")
    return 0


def cmd_process(args: argparse.Namespace) -> int:
    """``prefect-jax process [--processes N --service S] -- <the worker's flow-run command>``: the
    command of every replica of a multi-process work pool. It finds this process's place from
    the environment (a Kubernetes indexed job: ``--processes``, ``JOB_COMPLETION_INDEX`` and
    ``JOB_NAME``, process 0 being ``<job>-0.<service>:<port>``; Vertex AI: ``CLUSTER_SPEC``; or
    ``PREFECT_JAX_*``), then process 0 runs the flow run (the command after ``--``, ``prefect
    flow-run execute`` by default) and every other process runs its child flow run
    (`prefect_jax.flows.run_as_process`)."""
    from prefect_jax.training import cluster

    env = os.environ
    if args.processes is not None and args.processes < 1:
        raise ValueError(f"--processes={args.processes}: the number of JAX processes must be 1 or more")
    if args.processes is not None:
        env.setdefault(cluster.NUM_PROCESSES, str(args.processes))
    if not env.get(cluster.COORDINATOR) and (args.processes or 1) > 1:
        if not env.get("JOB_NAME") or not args.service:
            raise ValueError(
                f"no coordinator address: set {cluster.COORDINATOR} (process 0's host:port), or run in an indexed job's pod "
                "with JOB_NAME (the job's name, from the downward API) and --service (its headless service)"
            )
        env[cluster.COORDINATOR] = f"{env['JOB_NAME']}-0.{args.service}:{args.coordinator_port}"
    command = [a for a in args.command if a != "--"] or ["prefect", "flow-run", "execute"]
    found = cluster.from_env()
    if found is not None and found.auto:
        raise ValueError(
            f"{cluster.NUM_PROCESSES}=auto: 'prefect-jax process' must know before JAX starts which process runs the flow "
            "run; set PREFECT_JAX_PROCESS_ID, or run 'prefect-jax run' in each task (as with srun) instead"
        )
    if found is None or found.process_id == 0:
        sys.stdout.flush()
        os.execvp(command[0], command)  # process 0 (or the only one): the flow run itself
    from prefect_jax import flows, startup

    startup.claim_process()  # its first trainer is made with the collector off, then frozen
    with prefect_backend():
        flows.run_as_process()
    return 0


def cmd_automations_create(args: argparse.Namespace) -> int:
    from prefect_jax.deployments.automations import create_rerun_automation

    automation_id = create_rerun_automation(args.deployment, args.name)
    print(json.dumps({"automation_id": str(automation_id), "deployment": args.deployment}))
    return 0


def _add_training_args(p: argparse.ArgumentParser, max_steps: int, every: int) -> None:
    p.add_argument("--max-steps", type=int, default=max_steps, help=f"train until this global step (default {max_steps})")
    p.add_argument("--checkpoint-every-steps", type=int, default=every, help=f"checkpoint cadence in steps (default {every})")
    p.add_argument("--checkpoint-every-secs", type=float, default=None, help="also checkpoint every N seconds")
    p.add_argument("--keep-last", type=int, default=3, help="keep the newest N checkpoints (default 3)")
    p.add_argument("--keep-every-steps", type=int, default=None, help="also keep checkpoints at multiples of N")
    p.add_argument(
        "--no-backups", dest="backups", action="store_false",
        help="never write backups (resume-only checkpoints between the cadence's, written once attempts of the job were killed without notice)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="init and data-order seed (default 0)")
    p.add_argument("--log-every-steps", type=int, default=50, help="train metrics to MLflow every N steps (default 50)")
    p.add_argument(
        "--steps-per-dispatch", type=int, default=1, help="run K steps per call into the device, as one lax.scan (default 1)"
    )
    p.add_argument("--eval-steps", type=int, default=None, help="eval batches (default: the whole eval set)")
    p.add_argument("--eval-name", default="eval", help="eval name (default 'eval')")
    p.add_argument("--throttle-secs", type=float, default=0.0, help="minimum seconds between evaluations")
    p.add_argument(
        "--exporters",
        nargs="*",
        choices=["latest", "best", "final"],
        default=["latest", "best", "final"],
        help="exporters to run after each evaluation (default: latest best final)",
    )
    p.add_argument(
        "--registered-model",
        default=None,
        metavar="NAME",
        help="MLflow registered model the exports become versions of, aliases @best @final @newest "
        "(default: the job's name; '' for none)",
    )
    p.add_argument(
        "--export-platforms",
        type=lambda v: [name.strip() for name in v.split(",") if name.strip()],
        default=None,
        metavar="P,P",
        help="platforms the exported model runs on, of cpu,cuda,rocm,tpu (default: all that serve() lowers for; "
        "a warning names those left out)",
    )
    p.add_argument("--best-metric", default="loss", help="metric the best exporter compares (default loss)")
    p.add_argument("--best-mode", choices=["min", "max"], default="min", help="'min' or 'max' (default min)")
    p.add_argument("--sigterm-grace-secs", type=float, default=25.0, help="on SIGTERM, seconds to commit the step in flight")
    p.add_argument("--lease-timeout-secs", type=float, default=120.0, help="take over a job lease silent this long")
    p.add_argument(
        "--compilation-cache",
        default=None,
        metavar="DIR|job",
        help="JAX persistent compilation cache directory or URL ('job': under the job's storage), so reruns skip compiling",
    )
    p.add_argument("--checkpoint-path", default=None, help="warm-start a new job from this checkpoint step directory")
    p.add_argument("--mlflow-tracking-uri", default=None, help="MLflow tracking URI")
    p.add_argument("--mlflow-experiment", default="prefect-jax", help="MLflow experiment (default prefect-jax)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    # No prefix matching (--max-step is not --max-steps): a typo is an error, never a guess.
    parser = argparse.ArgumentParser(prog="prefect-jax", description="Train JAX models reliably on Prefect.", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)

    demo = sub.add_parser("demo", help="train the digits example on embedded defaults")
    demo.add_argument("--workdir", default="./prefect-jax-demo", help="where checkpoints and MLflow go (default ./prefect-jax-demo)")
    _add_training_args(demo, max_steps=1000, every=200)
    demo.set_defaults(fn=cmd_demo)

    roles = {
        "run": "train any program with train_and_evaluate: train, evaluate and export every checkpoint",
        "train": "the trainer role: train and checkpoint until max_steps (an evaluator runs elsewhere)",
        "evaluate": "the evaluator role: evaluate each new committed checkpoint of a job once, and export",
        "export": "run the exporters on an evaluated step of a job (default: the newest)",
    }
    for name, help_text in roles.items():
        role = sub.add_parser(name, help=help_text, description=help_text)
        role.add_argument("--program", required=True, help="program import path, 'package.module:attribute'")
        role.add_argument("--job", required=True, help="job name")
        role.add_argument(
            "--storage", required=True, help="storage root: a directory, an fsspec URL (s3://, gs://...) or jax-checkpoint-storage/<block>"
        )
        _add_training_args(role, max_steps=1000, every=200)
        if name == "evaluate":
            role.add_argument("--once", action="store_true", help="stop when nothing new is left to evaluate")
            role.add_argument("--newest-only", action="store_true", help="evaluate only the newest checkpoint, not every one")
            role.add_argument("--poll-secs", type=float, default=10.0, help="how often to look for new checkpoints (default 10)")
            role.add_argument("--idle-timeout-secs", type=float, default=None, help="stop after this long without a new checkpoint")
            role.add_argument(
                "--wait-for-first-checkpoint-secs", type=float, default=3600.0, help="give up waiting for a first checkpoint after this long"
            )
        if name == "export":
            role.add_argument("--step", type=int, default=None, help="the evaluated step to export (default: the newest)")
        if name in ("run", "train"):
            role.add_argument(
                "--processes", type=int, default=1, metavar="N",
                help="train as N JAX processes on this machine (data parallel, one job; default 1). On a cluster, "
                "set PREFECT_JAX_NUM_PROCESSES & co. per process instead (see the README)",
            )  # fmt: skip
        role.set_defaults(fn=cmd_run)

    process = sub.add_parser(
        "process", help="one pod of a multi-process work pool: process 0 runs the flow run, the others join it",
        description=cmd_process.__doc__.split("\n\n")[0].replace("``", "'"),
    )  # fmt: skip
    process.add_argument("--processes", type=int, default=None, metavar="N",
                         help="how many JAX processes train the job (default: from the environment, e.g. Vertex's CLUSTER_SPEC)")
    process.add_argument("--service", default=None, help="the indexed job's headless service (process 0's address)")
    process.add_argument("--coordinator-port", type=int, default=8476, help="process 0's coordinator port (default 8476)")
    process.add_argument("command", nargs=argparse.REMAINDER, help="-- and the worker's command for process 0")
    process.set_defaults(fn=cmd_process)

    status = sub.add_parser("status", help="committed, evaluated and exported steps of a job")
    status.add_argument("--job", required=True)
    status.add_argument("--storage", required=True, help="as for run")
    status.add_argument("--json", action="store_true")
    status.set_defaults(fn=cmd_status)

    automations = sub.add_parser("automations", help="Prefect automations for training jobs")
    automations_sub = automations.add_subparsers(dest="automations_command", required=True)
    create = automations_sub.add_parser(
        "create", help="rerun crashed runs of a trainer deployment automatically (they resume from their checkpoint)"
    )
    create.add_argument("--deployment", required=True, help="the trainer deployment, 'flow-name/deployment-name'")
    create.add_argument("--name", default=None, help="automation name (default: 'prefect-jax: rerun crashed <deployment>')")
    create.set_defaults(fn=cmd_automations_create)
    return parser


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: no abbreviations, and its own usage on an error (an unknown flag
    included), not the top-level one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        flags = [a for a in extras if a.startswith("-")]
        if flags:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def main(argv: list[str] | None = None) -> int:
    from prefect_jax.bytecode import write_bytecode

    write_bytecode()
    _quiet_env()
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command in ("demo", "run", "train", "evaluate", "export"):
        from prefect_jax.training.preemption import deliver_lost_notices

        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        deliver_lost_notices()
    from prefect_jax.training.errors import LeaseHeldError, NonFiniteLossError, StorageNotWritableError

    try:
        return args.fn(args)
    except BaseException as exc:
        if isinstance(exc, (SystemExit, KeyboardInterrupt, GeneratorExit)):
            raise
        # Any other error (an Exception, or such as pyo3's `PanicException`, a BaseException: seen
        # when a SIGTERM's SystemExit broke pydantic-core's import of `datetime`).
        from prefect_jax.training.preemption import received_signal

        signum = received_signal()
        if signum is not None:
            # Terminated: whatever error the signal caused on its way out is not the story.
            print(f"prefect-jax {args.command}: terminated by signal {signum}; the newest committed step is kept: "
                  f"run the same command again to resume ({type(exc).__name__}: {exc})", file=sys.stderr)  # fmt: skip
            return 128 + signum
        if isinstance(exc, (LeaseHeldError, NonFiniteLossError, StorageNotWritableError)):
            print(f"prefect-jax {args.command}: error: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, (ValueError, FileNotFoundError)):
            print(f"prefect-jax {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise


def entry() -> None:
    """The ``prefect-jax`` console script: `main`, then a quick exit.

    A process that imported JAX, Orbax, MLflow and Prefect spends ~1.5 s (2 CPUs) in Python's
    own teardown after its work is done: freeing every module and XLA's client, one object at a
    time. A rerun after a preemption waits for it. So, once `main` returns, this does what a
    normal exit does that matters (wait for non-daemon threads, run the atexit handlers: log,
    Prefect and MLflow flushes; flush stdout and stderr) and then ends the process without the
    teardown. An uncaught exception exits the usual way, with its traceback.

    Terminated by SIGTERM (exit 143), the process does not wait for its background threads
    either: the step in flight was committed (or abandoned) within ``sigterm_grace_secs``
    already, and what MLflow's thread had not written yet (a run still being created, metrics)
    is written by the rerun from the checkpoints and eval records, as after a SIGKILL."""
    try:
        code = main()
    except SystemExit as exc:  # argparse's exits, and SIGTERM handed back by Prefect (`_exit_on_sigterm`)
        if not isinstance(exc.code, int):
            raise
        code = exc.code
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls first at exit
    if shutdown is None:  # pragma: no cover - another Python: the usual exit
        sys.exit(code)
    cluster = sys.modules.get("prefect_jax.training.cluster")
    if cluster is not None:  # a process of several that lost another exits from its atexit handler: with this code
        cluster.exit_code = code
    if code != 128 + signal.SIGTERM:
        shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
