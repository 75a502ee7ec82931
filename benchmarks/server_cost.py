"""What each kind of Prefect call that a checkpoint interval makes costs the Prefect server, in CPU.

A `train_and_evaluate` interval is two task runs (train, evaluate) and two events (checkpoint
committed, eval completed); a table artifact (the results) and a progress artifact update come
with it when `PREFECT_JAX_UI_REFRESH_SECS` (2 s) has passed since the last of each.
This runs a flow of 100 iterations of each kind alone against a standing `prefect server` of its
own (SQLite, as `run.py` starts one) and prints the server's CPU time per iteration, from the
flow's start until the server is idle again, beside an empty flow's. The loop's own log lines are
off (`PREFECT_LOGGING_LEVEL=WARNING`, as in `run.py`'s sides).

    uv run --group bench python benchmarks/server_cost.py [--iterations 100] [--repeats 3]

Its last stdout line is one JSON object: per kind, the server's and the flow process's CPU ms per
iteration (medians of the repeats, less the empty flow's). The flow's wall time is not a measure
here: Prefect's end of a flow run waits for its heartbeat thread, which ticks in whole seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("empty", "two_task_runs", "two_events", "table_artifact", "progress_update")

# The flow each child process runs: one kind, `n` iterations, after one unmeasured warm-up run.
CHILD = r"""
import sys
from prefect import flow, task
from prefect.artifacts import (
    create_progress_artifact, create_table_artifact, update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

kind, n = sys.argv[1], int(sys.argv[2])

@task(cache_policy=NO_CACHE)
def step(i):
    return i

@flow
def iterations():
    progress = create_progress_artifact(0.0) if kind == "progress_update" else None
    for i in range(n):
        if kind == "two_task_runs":
            step(i)
            step(i)
        elif kind == "two_events":
            for name in ("committed", "evaluated"):
                emit_event(event=f"server-cost.{name}",
                           resource={"prefect.resource.id": "server-cost.job"}, payload={"step": i})
        elif kind == "table_artifact":
            table = [{"step": j, "accuracy": 0.5, "loss": 0.1} for j in range(i + 1)]
            create_table_artifact(key="server-cost", table=table)
        elif kind == "progress_update":
            update_progress_artifact(progress, 100.0 * (i + 1) / n)

iterations()  # warm-up: the server registers the flow
print("ready", flush=True)
if not sys.stdin.readline():  # the parent went away
    sys.exit(1)
iterations()
print("done", flush=True)
sys.stdin.readline()  # its CPU time is read before it exits
"""


def _read_lines(stream, lines: queue.Queue) -> None:
    """Each line of `stream` into `lines`, then "" at its end (the child exited)."""
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put("")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    import psutil
    from standing_server import StandingServer

    def process_cpu_s(pid: int) -> float:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system

    def expect(lines: queue.Queue, word: str, kind: str, timeout: float = 300.0) -> None:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(
                f"server_cost: the {kind} flow did not say {word!r} within {timeout:.0f} s"
            ) from None
        if line.strip() != word:
            raise RuntimeError(
                f"server_cost: the {kind} flow said {line.strip()!r} (exited?) "
                f"where {word!r} was due"
            )

    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    with (
        tempfile.TemporaryDirectory(prefix="server-cost-") as work,
        StandingServer(os.path.join(work, "home")) as server,
    ):
        env = dict(
            os.environ,
            PREFECT_API_URL=server.url,
            PREFECT_HOME=os.path.join(work, "client"),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_LOGGING_LEVEL="WARNING",
        )
        for r in range(args.repeats):
            for kind in KINDS:  # interleaved: a slow minute on shared cores hits every kind once
                child = subprocess.Popen(
                    [sys.executable, "-c", CHILD, kind, str(args.iterations)],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                lines: queue.Queue = (
                    queue.Queue()
                )  # its stdout, read on a thread: a stalled child times out
                threading.Thread(
                    target=_read_lines, args=(child.stdout, lines), daemon=True
                ).start()
                try:
                    expect(lines, "ready", kind)
                    server.settle(limit_s=10.0)
                    before, client_before = server.cpu_s(), process_cpu_s(child.pid)
                    child.stdin.write("\n")
                    child.stdin.flush()
                    expect(lines, "done", kind)
                    client_s = process_cpu_s(child.pid) - client_before
                    server.settle(
                        limit_s=10.0
                    )  # the server records a flow run's last events after it ends
                    server_s = server.cpu_s() - before
                    child.stdin.write("\n")
                    child.stdin.close()
                    child.wait(timeout=60)
                finally:
                    if (
                        child.poll() is None
                    ):  # left behind by a failure: it must not outlive this run
                        child.kill()
                        child.wait()
                samples[kind].append((server_s, client_s))
                print(
                    f"[server_cost] {kind}, round {r + 1}/{args.repeats}: per iteration, "
                    f"server CPU {server_s * 1000 / args.iterations:.1f} ms, "
                    f"the flow's CPU {client_s * 1000 / args.iterations:.1f} ms",
                    file=sys.stderr,
                )

    def ms(values):
        return round(statistics.median(values) * 1000 / args.iterations, 1)

    empty, empty_client = ms([s for s, _ in samples["empty"]]), ms([c for _, c in samples["empty"]])
    out = {
        "iterations": args.iterations,
        "repeats": args.repeats,
        "empty_flow_server_cpu_ms": empty,
        "empty_flow_cpu_ms": empty_client,
        **{
            kind: {
                "server_cpu_ms": round(ms([s for s, _ in samples[kind]]) - empty, 1),
                "flow_cpu_ms": round(ms([c for _, c in samples[kind]]) - empty_client, 1),
            }
            for kind in KINDS
            if kind != "empty"
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
