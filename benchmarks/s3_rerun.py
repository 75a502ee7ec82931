"""Reruns of the byte LM's goodput job on S3, each on a new machine: how soon it trains again.

The goodput job (`goodput_lm.py`: ``prefect-jax run`` of the byte LM, ``small`` preset, batch 4,
``--compilation-cache job``, a standing Prefect server) with its storage on moto's S3 server on
loopback. A first attempt starts the job; then each rerun gets an empty ``PREFECT_JAX_CACHE_DIR``
(a new machine: nothing staged, so its restore downloads the step) and is SIGTERM'd --kill-at
seconds after its start, as a preempted attempt is. With --old, reruns alternate between this
checkout and the one at --old (``PYTHONPATH``), so the two are compared in one run on the same
job. With --rate, loopback traffic is held to that rate while the reruns run (``tc`` with a
token bucket on ``lo``: root only), as a bucket across a network would be; the Prefect server's
traffic shares that rate, as it shares a machine's network.

From the job's goodput ledger, per rerun: start-up, restore and compile, and their sum: the
process's start to the end of its first new step.

    sudo uv run --group bench python benchmarks/s3_rerun.py --old ../before --rate 100mbit

Prints one JSON line (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def limit_loopback(rate: str | None, held: bool) -> None:
    """Loopback held to `rate` (a token bucket whose burst exceeds lo's 64 KiB packets) or freed
    (`held` False); nothing where no --rate was given."""
    if not rate:
        return
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    if held:
        subprocess.run(
            ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate]
            + ["burst", "1mb", "latency", "500ms"],
            check=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reruns", type=int, default=8)
    parser.add_argument("--kill-at", type=float, default=22.0, help="seconds after each start")
    parser.add_argument("--old", default=None, help="a checkout to alternate with this one")
    parser.add_argument("--rate", default=None, help="loopback rate while reruns run (tc)")
    parser.add_argument(
        "--out", default=None, help="a record to add this run to (S3_RERUN.json), or to start"
    )
    parser.add_argument("--measured", default=None, help="when and where, for a new record")
    args = parser.parse_args()

    import goodput_lm
    from s3_server import ACCESS_KEY, SECRET_KEY, S3Server, isolate_aws_env
    from standing_server import StandingServer

    # (enough steps that no rerun finds the job finished: about 13 steps a rerun here)
    job = argparse.Namespace(
        lm_params=None, steps=max(120, 20 * (args.reruns + 1)), every=10, prefect_jax_args=""
    )
    corpus = goodput_lm.build_corpus(job)
    work = tempfile.mkdtemp(prefix="s3-rerun-")
    sides: list[str] = []
    try:
        with S3Server() as s3, StandingServer(os.path.join(work, "server-home")) as server:
            s3.create_bucket("jobs")
            env = dict(os.environ)
            isolate_aws_env(env)
            env.update(
                AWS_ACCESS_KEY_ID=ACCESS_KEY,
                AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                FSSPEC_S3_ENDPOINT_URL=s3.endpoint_url,
                PREFECT_API_URL=server.url,
                PREFECT_HOME=os.path.join(work, "client-home"),
                PREFECT_SERVER_ANALYTICS_ENABLED="false",
            )
            for i in range(args.reruns + 1):
                side = "old" if args.old and i % 2 else "new"
                cmd = goodput_lm.prefect_jax_command(job, work)
                cmd[cmd.index("--storage") + 1] = "s3://jobs/team"
                run_env = dict(env, PREFECT_JAX_CACHE_DIR=os.path.join(work, f"machine-{i}"))
                if side == "old":
                    run_env["PYTHONPATH"] = os.path.abspath(args.old)
                limit_loopback(args.rate, held=i > 0)
                proc = subprocess.Popen(
                    cmd, env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                try:
                    proc.wait(args.kill_at)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait()
                limit_loopback(args.rate, held=False)
                if proc.returncode not in (0, 143, -signal.SIGTERM):
                    raise SystemExit(f"attempt {i} ({side}) exited {proc.returncode}")
                sides.append(side)
                print(f"attempt {i} ({side}) done", file=sys.stderr, flush=True)
            ledger = json.loads(s3.filesystem().cat_file("jobs/team/gp/goodput.json"))
    finally:
        limit_loopback(args.rate, held=False)
    reruns: dict[str, list[dict]] = {"new": [], "old": []}
    for side, attempt in list(zip(sides, ledger["attempts"], strict=True))[1:]:
        s = attempt["seconds"]
        parts = {k: round(s.get(k, 0.0), 2) for k in ("startup", "restore", "compile")}
        parts["to_first_step"] = round(sum(parts.values()), 2)
        reruns[side].append({"from_step": attempt.get("from_step"), **parts})
    out = {
        "rate": args.rate,
        "kill_at": args.kill_at,
        "old": args.old,
        "reruns": {k: v for k, v in reruns.items() if v},
        "mean_to_first_step": {
            k: round(statistics.mean(r["to_first_step"] for r in v), 2)
            for k, v in reruns.items()
            if v
        },
    }
    line = json.dumps(out)
    if args.out:
        record = {"measured": args.measured or time.strftime("%Y-%m-%d"), "runs": []}
        if os.path.exists(args.out):
            with open(args.out) as f:
                record = json.load(f)
        mib = 3 * 4 * corpus["param_count"] / 2**20  # fp32 weights and AdamW's two moments
        record.setdefault(
            "state",
            f"about {mib:.0f} MiB: {corpus['param_count'] / 1e6:.1f}M "
            "parameters and AdamW's two moments in fp32, and the Grain position",
        )
        record["runs"].append(out)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    print(line)


if __name__ == "__main__":
    main()
