"""Several JAX processes for one job: ``run``/``train --processes N`` on this machine (this
command N times, each with its share of the machine's GPUs), and ``prefect-jax process``, the
command of every replica of a multi-process work pool."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from prefect_jax.cli.server import die_with_parent, prefect_backend


def process_envs(
    n: int, coordinator: str, api_url: str, embedded: bool, environ: dict | None = None
) -> list[dict[str, str]]:
    """The environments of ``--processes N``'s processes: the cluster (``PREFECT_JAX_*``), one
    Prefect API, and each process's share of this machine's GPUs (`gpu_envs`)."""
    environ = dict(os.environ if environ is None else environ)
    envs = []
    for k, gpus in enumerate(gpu_envs(n, environ)):
        env = dict(
            environ,
            PREFECT_API_URL=api_url,
            PREFECT_JAX_NUM_PROCESSES=str(n),
            PREFECT_JAX_PROCESS_ID=str(k),
            PREFECT_JAX_COORDINATOR_ADDRESS=coordinator,
            **gpus,
        )
        if embedded:
            env["PREFECT_JAX_EMBEDDED_API"] = "1"
        envs.append(env)
    return envs


def _visible_gpus(environ: dict[str, str]) -> int:
    """How many NVIDIA GPUs a process started with `environ` sees: ``CUDA_VISIBLE_DEVICES`` (CUDA
    stops at its first entry that is no index, ``GPU-`` or ``MIG-`` UUID), else
    ``nvidia-smi -L``."""
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
        listed = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, env=environ
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.splitlines() if line.startswith("GPU "))


def gpu_envs(n: int, environ: dict[str, str]) -> list[dict[str, str]]:
    """What each of `n` processes on this machine needs to share its NVIDIA GPUs: its own, as
    JAX's ``JAX_LOCAL_DEVICE_IDS`` (`jax.distributed.initialize` reads it),
    ``{"JAX_LOCAL_DEVICE_IDS": "0,1,2,3"}`` and ``"4,5,6,7"`` for 2 processes on 8 GPUs. Without
    it every process opens every GPU (JAX splits them by itself only under SLURM or Open MPI),
    each client taking 75% of every GPU's memory. Fewer GPUs than processes: they share them,
    without preallocation.

    Nothing: no NVIDIA GPU here (or ``JAX_PLATFORMS`` names none), or ``JAX_LOCAL_DEVICE_IDS``
    set already."""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    no_gpu_platform = platforms and not any(p in platforms for p in ("cuda", "gpu"))
    if environ.get("JAX_LOCAL_DEVICE_IDS") or no_gpu_platform:
        return [{} for _ in range(n)]
    count = _visible_gpus(environ)
    if count == 0:
        return [{} for _ in range(n)]
    if count < n:
        print(
            f"prefect-jax: {n} processes share {count} GPU(s): each opens all of them, without "
            "preallocating their memory (XLA_PYTHON_CLIENT_PREALLOCATE=false)",
            file=sys.stderr,
        )
        preallocate = environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        return [{"XLA_PYTHON_CLIENT_PREALLOCATE": preallocate} for _ in range(n)]
    per = count // n
    if count % n:
        print(
            f"prefect-jax: {n} processes on {count} GPUs: {per} each, GPUs {per * n}-{count - 1} "
            f"idle; run a number of processes that divides {count} to use them all",
            file=sys.stderr,
        )
    return [
        {"JAX_LOCAL_DEVICE_IDS": ",".join(str(i) for i in range(k * per, (k + 1) * per))}
        for k in range(n)
    ]


def _check_storage(args: argparse.Namespace, processes: int) -> None:
    """Refuse storage that `processes` processes cannot write one checkpoint on, before they
    start (each would fail in its flow run, and JAX's distributed service abort the others)."""
    from prefect_jax.blocks import resolve_storage
    from prefect_jax.training import facade

    url, options = resolve_storage(args.storage)
    facade.check_shared_by(args.job, url, options, processes)


def launch_processes(args: argparse.Namespace) -> int:
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

    from prefect_jax.blocks import BLOCK_PREFIX

    named_block = args.storage.startswith(BLOCK_PREFIX)
    if not named_block:  # before any server starts
        _check_storage(args, n)
    embedded = not PREFECT_API_URL.value()  # as prefect_backend decides
    with prefect_backend() as api_url:
        if named_block:  # (read from the Prefect API)
            _check_storage(args, n)
        procs: list[subprocess.Popen] = []
        for k, env in enumerate(process_envs(n, f"127.0.0.1:{port}", api_url, embedded)):
            extra = [] if k == 0 else ["--no-progress"]
            # Their own sessions: a Ctrl-C or SIGTERM reaches each once, forwarded from here.
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "prefect_jax.cli", *argv, *extra],
                    env=env,
                    stdout=None if k == 0 else subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=die_with_parent(),
                )
            )
        signalled: list[int] = []

        def forward(signum, frame):
            if frame is not None:
                # A signal to this launcher: the children's exits that follow are no failure of
                # theirs.
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
                        print(
                            f"prefect-jax: process {k} of {n} ended with {p.returncode}: "
                            "stopping the others",
                            file=sys.stderr,
                        )
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
    # A child killed by signal S: 128 + S, as a shell says.
    return 128 - failed if failed < 0 else failed


def cmd_process(args: argparse.Namespace) -> int:
    """``prefect-jax process [--processes N --service S] -- <the worker's flow-run command>``: the
    command of every replica of a multi-process work pool. It finds this process's place from
    the environment (a Kubernetes indexed job: ``--processes``, ``JOB_COMPLETION_INDEX`` and
    ``JOB_NAME``, process 0 being ``<job>-0.<service>:<port>``; Vertex AI: ``CLUSTER_SPEC``; or
    ``PREFECT_JAX_*``), then process 0 runs the flow run (the command after ``--``, ``prefect
    flow-run execute`` by default) and every other process runs its child flow run
    (`prefect_jax.flows.run_as_process`)."""
    from prefect_jax.training.facade import pod_process_id

    process_id = pod_process_id(os.environ, args.processes, args.service, args.coordinator_port)
    command = [a for a in args.worker_command if a != "--"] or ["prefect", "flow-run", "execute"]
    if process_id in (None, 0):
        sys.stdout.flush()
        os.execvp(command[0], command)  # process 0 (or the only one): the flow run itself
    from prefect_jax.cli import startup

    # This process is the command's own: its start-up's imports with the collector off, then
    # frozen (see `prefect_jax.cli.startup`). The engine (JAX, Orbax, Grain) is imported here too,
    # not later by the child flow run's first trainer, so that its objects are frozen with the rest.
    with startup.collector_off():
        import prefect_jax.training.trainer  # noqa: F401
        from prefect_jax import flows

        # The two flows that train in several processes, declared before the freeze too (the
        # parent run says which of them this process runs).
        flows.train_and_evaluate, flows.train  # noqa: B018
        with prefect_backend():
            startup.freeze_startup_objects()
            flows.run_as_process()
    return 0
