"""What a job on S3 asks the storage, per checkpoint interval: the `train_and_evaluate` flow (the
digits `tiny` program, a checkpoint and an evaluation every --every steps, 3 kept) on moto's S3
server on loopback, in this process, against an ephemeral Prefect server (Prefect's test harness).

Counted: every request that reaches S3 (per operation, all threads: the training thread, the
uploader, the commit announcer) and the storage calls the training thread waits for, with their
wall time (moto on loopback answers in a few ms; a real bucket in tens). Per interval is the slope
between --intervals' two counts, so start-up and end drop out. Then a rerun on a new machine (an
empty local stage): the calls its restore makes on the training thread before the first step.

    uv run python benchmarks/s3_requests.py [--every 10] [--intervals 10,30]
        [--out benchmarks/S3_REQUESTS.json]

Counts do not depend on the machine's speed (until 7881de6 the commit announcer's did: it asked
every 0.2 s while an upload was on its way); the wall times do. Requests are also counted by
operation and file (a step's files by the last part of their name).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")


def log(msg: str) -> None:
    print(f"[s3-requests] {msg}", file=sys.stderr, flush=True)


def snapshot(counts) -> dict:
    """The totals so far of a `StorageCalls` (tests/s3_server.py): requests per operation, the
    training thread's calls per kind in the flow's intervals, and their wait."""
    requests, calls, by_file = collections.Counter(), collections.Counter(), collections.Counter()
    for (operation, name), n in counts.requests.items():
        requests[operation] += n
        # a step's files by name, but for its numbers (the step's, an eval
        # record's) and hashes (data files)
        by_file[
            f"{operation} {re.sub(r'[0-9]+', 'N', re.sub(r'[0-9a-f]{16,}', '<hash>', name))}"
        ] += n
    for (kind, _), n in counts.calls["train_loop"].items():
        calls[kind] += n
    return {
        "requests": dict(requests),
        "requests_total": sum(requests.values()),
        "interval_calls": dict(calls),
        "interval_calls_total": sum(calls.values()),
        "interval_wait_s": counts.secs["train_loop"],
        "requests_by_file": dict(by_file),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument(
        "--intervals",
        default="10,30",
        help="two interval counts: the slope between them is per interval",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "S3_REQUESTS.json"))
    args = parser.parse_args()
    few, many = sorted(int(n) for n in args.intervals.split(","))
    if few < 1 or many <= few:
        parser.error(
            f"--intervals {args.intervals}: give two counts, the second larger, such as 10,30"
        )
    sys.path.insert(0, TESTS)
    from s3_server import S3Server, StorageCalls, isolate_aws_env

    isolate_aws_env()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    counts = StorageCalls()
    counts.install()
    from prefect.testing.utilities import prefect_test_harness

    work = tempfile.mkdtemp(prefix="s3-requests-")
    report: dict = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "every": args.every,
        "runs": {},
    }
    with S3Server() as s3, prefect_test_harness(server_startup_timeout=180):
        s3.create_bucket("requests")
        from prefect_jax.flows import train_and_evaluate
        from prefect_jax.training.specs import CheckpointSpec, TrainSpec

        def flow(job: str, intervals: int, machine: str) -> None:
            os.environ["PREFECT_JAX_CACHE_DIR"] = os.path.join(work, machine)
            summary = train_and_evaluate(
                program="prefect_jax.examples.digits:tiny",
                job=job,
                storage=block,
                train_spec=TrainSpec(max_steps=intervals * args.every, log_every_steps=args.every),
                checkpoint_spec=CheckpointSpec(every_steps=args.every, keep_last=3),
                mlflow_tracking_uri=f"sqlite:///{work}/mlflow.db",
            )
            assert summary["final_step"] == intervals * args.every, summary

        block = s3.save_block("requests", "s3://requests/jobs")
        for n in (few, many):
            before = snapshot(counts)
            flow(f"j{n}", n, f"machine-{n}")
            after = snapshot(counts)
            report["runs"][n] = {
                k: (after[k] - before[k])
                if not isinstance(after[k], dict)
                else {op: after[k].get(op, 0) - before[k].get(op, 0) for op in after[k]}
                for k in after
            }
            log(
                f"{n} intervals: {report['runs'][n]['requests_total']} requests, "
                f"{report['runs'][n]['interval_calls_total']} "
                "training-thread calls in the intervals"
            )
        # A rerun on a new machine (its stage empty): what its restore asks before the first step.
        restore = counts.calls["restore_trainer"]
        restore.clear()
        counts.secs["restore_trainer"] = 0.0
        flow(f"j{many}", many + 1, "a-new-machine")
        kinds = collections.Counter()
        for (kind, _), n in restore.items():
            kinds[kind] += n
        report["rerun_restore"] = {
            "calls": dict(kinds),
            "calls_total": sum(kinds.values()),
            "wait_s": round(counts.secs["restore_trainer"], 3),
        }
    a, b = report["runs"][few], report["runs"][many]
    per = lambda key: (b[key] - a[key]) / (many - few)  # noqa: E731
    report["per_interval"] = {
        "requests": round(per("requests_total"), 2),
        "requests_by_operation": {
            op: round((b["requests"].get(op, 0) - a["requests"].get(op, 0)) / (many - few), 2)
            for op in sorted(set(a["requests"]) | set(b["requests"]))
        },
        # (a step's files are named by their last part: "PutObject manifest.ocdbt")
        "requests_by_operation_and_file": {
            k: v
            for k in sorted(set(a["requests_by_file"]) | set(b["requests_by_file"]))
            if (
                v := round(
                    (b["requests_by_file"].get(k, 0) - a["requests_by_file"].get(k, 0))
                    / (many - few),
                    2,
                )
            )
        },
        "training_thread_calls": round(per("interval_calls_total"), 2),
        "training_thread_calls_by_kind": {
            k: round(
                (b["interval_calls"].get(k, 0) - a["interval_calls"].get(k, 0)) / (many - few), 2
            )
            for k in sorted(set(a["interval_calls"]) | set(b["interval_calls"]))
        },
        "training_thread_wait_ms": round(1000 * per("interval_wait_s"), 1),
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(
        json.dumps(
            {"per_interval": report["per_interval"], "rerun_restore": report["rerun_restore"]}
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
