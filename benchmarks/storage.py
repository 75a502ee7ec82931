"""Checkpoint save and restore of a large state: local disk and S3 (moto's server on loopback),
each beside the raw cost of moving the same bytes.

- local: Orbax save (+ wait until committed) and restore, against writing / reading the same
  bytes with numpy.
- s3: the local staged save + upload with its commit marker (`RemoteSteps.upload`), and
  download + restore, against a raw fsspec ``put`` / ``get`` of one file of the same size.
- stall: how long `Trainer`-style asynchronous saving blocks the caller (``save`` returns
  once the arrays are off the device), against a synchronous save.

    uv run python benchmarks/storage.py [--mib 256]

Progress goes to stderr; the last stdout line is one JSON object with times and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def log(msg: str) -> None:
    print(f"[storage] {msg}", file=sys.stderr, flush=True)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    args = parser.parse_args()

    import grain
    import jax
    import numpy as np

    from prefect_jax.training.checkpoints import Checkpoints, state_fingerprint
    from prefect_jax.training.remote import RemoteSteps
    from prefect_jax.training.specs import CheckpointSpec
    from s3_server import S3Server, isolate_aws_env

    isolate_aws_env()
    work = tempfile.mkdtemp(prefix="prefect-jax-storage-")
    n = args.mib * 1024 * 1024 // 4
    rng = np.random.default_rng(0)
    state = {"w": jax.device_put(rng.standard_normal(n, dtype=np.float32))}
    abstract = jax.eval_shape(lambda: state)
    data_iter = iter(grain.MapDataset.range(10).to_iter_dataset())
    spec = CheckpointSpec(every_steps=1, keep_last=None)
    result: dict = {"mib": args.mib}

    # -- local ---------------------------------------------------------------------------------
    local = Checkpoints(os.path.join(work, "local"), spec)
    result["local_save_s"], _ = timed(lambda: (local.save(1, state, data_iter, {}), local.wait()))
    result["local_restore_s"], (restored, _) = timed(lambda: local.restore(1, abstract))
    assert state_fingerprint(restored) == state_fingerprint(state)
    raw_path = os.path.join(work, "raw.npy")
    host = np.asarray(state["w"])

    def raw_write():
        with open(raw_path, "wb") as f:
            np.save(f, host)
            f.flush()
            os.fsync(f.fileno())

    result["raw_write_s"], _ = timed(raw_write)
    result["raw_read_s"], _ = timed(lambda: np.load(raw_path))
    # Stall: the caller's time in save() (async) against a synchronous save of the same state.
    result["async_save_call_s"], _ = timed(lambda: local.save(2, state, data_iter, {}))
    local.wait()
    result["sync_save_s"], _ = timed(lambda: (local.save(3, state, data_iter, {}), local.wait()))
    log(f"local: {result}")

    # -- s3 ------------------------------------------------------------------------------------
    with S3Server() as s3:
        s3.create_bucket("bench")
        remote = RemoteSteps("s3://bench/job/checkpoints", s3.storage_options)
        step_dir = os.path.join(local.directory, "1")
        result["s3_upload_s"], _ = timed(lambda: remote.upload(1, step_dir))
        result["s3_save_total_s"] = result["local_save_s"] + result["s3_upload_s"]
        cache = os.path.join(work, "cache")
        result["s3_download_s"], _ = timed(lambda: remote.download(1, cache))
        staged = Checkpoints(cache, spec, read_only=True)
        t_restore, (restored, _) = timed(lambda: staged.restore(1, abstract))
        assert state_fingerprint(restored) == state_fingerprint(state)
        result["s3_restore_total_s"] = result["s3_download_s"] + t_restore
        fs = s3.filesystem()
        result["raw_put_s"], _ = timed(lambda: fs.put_file(raw_path, "bench/raw.npy"))
        result["raw_get_s"], _ = timed(lambda: fs.get_file("bench/raw.npy", os.path.join(work, "raw-back.npy")))
        log(f"s3: {result}")

    local.close()
    shutil.rmtree(work, ignore_errors=True)
    r = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    r.update(
        benchmark="storage",
        local_save_vs_raw_write=round(result["local_save_s"] / result["raw_write_s"], 2),
        local_restore_vs_raw_read=round(result["local_restore_s"] / result["raw_read_s"], 2),
        s3_save_vs_raw_put=round(result["s3_save_total_s"] / result["raw_put_s"], 2),
        s3_restore_vs_raw_get=round(result["s3_restore_total_s"] / result["raw_get_s"], 2),
        async_stall_vs_sync_save=round(result["async_save_call_s"] / result["sync_save_s"], 3),
        machine=f"{platform.platform()}; {os.cpu_count()} cpus; python {platform.python_version()}",
    )
    print(json.dumps(r))


if __name__ == "__main__":
    main()
