"""The suite's child processes, run and timed from the parent: a side of `run.py` (``run.py
--side NAME``, one system's job in a fresh process), the user's ``prefect-jax run`` command, or
another benchmark script; each child's JSON result with its whole process's time, peak RSS and
CPU. Also the standing server that scripts driving the sides share (`sides_server`), their two
interval counts, and the machine's description. Used by `run.py`, `floor.py`, `thread_cpu.py` and
`server_apart.py`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from standing_server import StandingServer

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = os.path.join(HERE, "run.py")  # a side is `run.py --side NAME`
sys.dont_write_bytecode = False  # as tests/bytecode_cache.py, for this process and its sides:
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # every side loads .pyc files, none compiles


def log(msg: str) -> None:
    print(f"[run] {msg}", file=sys.stderr, flush=True)


def run_child(cmd: list[str], env: dict, name: str) -> dict | None:
    """Run a child; its last stdout line is its JSON result, to which this adds ``process_s`` (the
    whole process, from its start to its exit: interpreter, imports, work, teardown) and
    ``peak_rss_mib`` (its peak resident memory, from the kernel's rusage) and ``cpu_s`` (its user
    and system CPU time, with that of the children it waited for, such as its MLflow worker)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        process_s = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        log(f"{name} FAILED (exit {proc.returncode}):\n{stderr[-3000:]}")
        return None
    result = json.loads(lines[-1])
    result.update(
        process_s=process_s,
        peak_rss_mib=usage.ru_maxrss / 1024,
        cpu_s=usage.ru_utime + usage.ru_stime,
    )
    log(
        f"{name} ({process_s:.0f}s): "
        + ", ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
            for k, v in result.items()
            if not isinstance(v, (dict, list))
        )
    )
    return result


def run_cli(args, env: dict, label: str = "cli", exports: bool = False) -> dict | None:
    """The user's command, `prefect-jax run`, as its own process on the same work: timed whole, as
    a person or a worker runs it. No exporters (the other sides export nothing), or with
    `exports` its defaults (latest, best, final: each export a version of an MLflow registered
    model), as a user who sets none runs it."""
    workdir = tempfile.mkdtemp(prefix="bench-cli-")
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "prefect-jax"),
        "run",
        "--program",
        "bench_programs:mlp",
        "--job",
        "bench",
        "--storage",
        workdir,
        "--max-steps",
        str(args.steps),
        "--checkpoint-every-steps",
        str(args.every),
        *([] if exports else ["--exporters"]),
        "--mlflow-tracking-uri",
        f"sqlite:///{workdir}/mlflow.db",
        "--json",
        "--no-progress",
    ]
    try:
        return run_child(
            cmd,
            dict(env, PYTHONPATH=os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH")]))),
            label,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def side(
    name: str,
    args,
    env: dict,
    steps: int | None = None,
    every: int | None = None,
    label: str | None = None,
    profile: str | None = None,
) -> dict | None:
    cmd = [
        sys.executable,
        RUN,
        "--side",
        name,
        "--steps",
        str(steps or args.steps),
        "--every",
        str(every or args.every),
        "--dispatch",
        str(args.dispatch),
    ]
    if profile:
        cmd += ["--profile", profile]
    return run_child(cmd, env, label or name)


def median_results(rounds: list[dict]) -> dict:
    """Per side, the median of each number over the rounds it finished (None: it failed in all);
    what is not a number (the final eval, the code's folder) from its first finished round."""
    import statistics

    out: dict = {}
    for name in rounds[0]:
        done = [r[name] for r in rounds if r.get(name)]
        if not done:
            out[name] = None
            continue
        merged = dict(done[0])
        for key, value in done[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = statistics.median(
                    d[key] for d in done if isinstance(d.get(key), (int, float))
                )
        out[name] = merged
    return out


@contextlib.contextmanager
def sides_server(prefix: str):
    """One standing server for a script that drives run.py's sides (`thread_cpu.py`,
    `floor.py`): yields (server, env, machine), env naming the server, after a first flow run."""
    from goodput_jobs import warm_up

    work = tempfile.mkdtemp(prefix=prefix)
    env = dict(
        os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING"
    )
    env.pop("PREFECT_API_URL", None)
    with StandingServer(os.path.join(work, "server-home")) as server:
        env = dict(env, PREFECT_API_URL=server.url, PREFECT_HOME=os.path.join(work, "client-home"))
        warm_up(env)
        yield server, env, machine()


def sides_parser(description: str, rounds: int) -> argparse.ArgumentParser:
    """The options of a script that drives run.py's sides at two interval counts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument(
        "--intervals",
        default="10,100",
        help="two interval counts over --steps: the slope between them is per interval",
    )
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser


def interval_counts(parser: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    """`--intervals` as two counts, the second larger: the slope between them is per interval."""
    few, many = sorted(int(n) for n in text.split(","))
    if few < 1 or many <= few:
        parser.error(f"--intervals {text}: give two counts, the second larger, such as 10,100")
    return few, many


def machine() -> dict:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gib": round(mem, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "devices": str(jax.devices()),
    }
