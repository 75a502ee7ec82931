"""Checkpoint save and restore of a large state: local disk and S3 (moto's server on loopback),
each beside the raw cost of moving the same bytes.

- local: Orbax save (+ wait until committed) and restore, against writing / reading the same
  bytes with numpy.
- s3: the local staged save + upload with its commit marker (`RemoteSteps.upload`), and
  download + restore, against a raw fsspec ``put`` / ``get`` of one file of the same size.
- stall: how long `Trainer`-style asynchronous saving blocks the caller (``save`` returns
  once the arrays are off the device), against a synchronous save.
- scale (``--scale``): the local measurements and the stall for a sweep of state sizes.

    uv run python benchmarks/storage.py [--mib 256]
    uv run python benchmarks/storage.py --scale [--sizes 1,16,64,256,512,1024] [--repeats 1]

Progress goes to stderr; the last stdout line is one JSON object with times and ratios. With
``--scale`` the sweep is also printed to stderr as a markdown table.

Importable without side effects (jax, Orbax and the test helpers load only when called):
`scale_table` runs the sweep and `scale_markdown` formats its rows; `local_round` is the one
local measurement both the sweep and `main` use.

What the times mean (the same in `main` and in the sweep):

- ``save_s``: ``Checkpoints.save`` + ``wait`` (Orbax committed the step) of a fresh step.
- ``stall_s``: the wall time of the ``Checkpoints.save(...)`` call alone, i.e. until it returns
  to the caller, with no earlier save in flight: building the savable tree and its metadata,
  Orbax's step-directory and metadata work, the grain iterator state and the copy of the arrays
  off the device (on a CPU backend: into a host buffer); the background write is then waited
  for outside the timing.
- ``sync_save_s``: another ``save`` + ``wait``, the cost a synchronous save would put on the
  caller (this project has no synchronous save path of its own; it is the same operation as
  ``save_s``, measured on a warm manager).
- ``restore_s``: ``Checkpoints.restore`` of the step saved for ``save_s`` (its files are most
  likely still in the page cache, as are ``raw_read_s``'s).
- ``raw_write_s`` / ``raw_read_s``: ``np.save`` + flush + fsync, and ``np.load``, of the same bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")

DEFAULT_SIZES = [1, 16, 64, 256, 512, 1024]
STALL_TARGET_PCT = 5.0  # the target: an async save stalls the caller <= 5% of a sync save

# Measured in `local_round`, in seconds; the sweep reports the median over repeats of each.
LOCAL_KEYS = ("save_s", "sync_save_s", "stall_s", "restore_s", "raw_write_s", "raw_read_s")


def log(msg: str) -> None:
    print(f"[storage] {msg}", file=sys.stderr, flush=True)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def machine() -> str:
    return f"{platform.platform()}; {os.cpu_count()} cpus; python {platform.python_version()}"


def make_state(mib: int, seed: int = 0):
    """The benchmark's state: ``{"w": float32[mib MiB]}`` of random normals (nothing compresses),
    on the default device, and its abstract tree (``jax.eval_shape``)."""
    import jax
    import numpy as np

    n = mib * 1024 * 1024 // 4
    host = np.random.default_rng(seed).standard_normal(n, dtype=np.float32)
    state = {"w": jax.device_put(host)}
    del host
    return state, jax.eval_shape(lambda: state)


def make_data_iter():
    import grain

    return iter(grain.MapDataset.range(10).to_iter_dataset())


def raw_io(host, path: str) -> tuple[float, float]:
    """(write_s, read_s): `host` (a numpy array) written with ``np.save`` + fsync, then read
    back."""
    import numpy as np

    def write():
        with open(path, "wb") as f:
            np.save(f, host)
            f.flush()
            os.fsync(f.fileno())

    write_s, _ = timed(write)
    read_s, back = timed(lambda: np.load(path))
    del back
    return write_s, read_s


def local_round(
    ckpt,
    state,
    abstract,
    data_iter,
    first_step: int,
    raw_path: str,
    fingerprint: str | None = None,
    keep_raw: bool = False,
) -> dict:
    """One round of the local measurements on `ckpt` (a `Checkpoints`), writing steps
    ``first_step .. first_step + 2``; see the module docstring for what each time means.

    The restore of step `first_step` is checked against `fingerprint` (`state_fingerprint` of
    `state`, computed here when not given). The raw file at `raw_path` is removed unless
    `keep_raw`. Returns the `LOCAL_KEYS` times in seconds.
    """
    import numpy as np

    from prefect_jax.training.trees import state_fingerprint

    fingerprint = fingerprint or state_fingerprint(state)
    s = first_step
    out: dict = {}
    out["save_s"], _ = timed(lambda: (ckpt.save(s, state, data_iter, {}), ckpt.wait()))
    out["restore_s"], (restored, _) = timed(lambda: ckpt.restore(s, abstract))
    if state_fingerprint(restored) != fingerprint:
        raise AssertionError(f"step {s} of {ckpt.directory} restored a different state")
    del restored
    host = np.asarray(state["w"])
    out["raw_write_s"], out["raw_read_s"] = raw_io(host, raw_path)
    del host
    if not keep_raw:
        os.remove(raw_path)
    # Stall: the caller's time in save() (async; nothing else in flight), then let it finish.
    ckpt.wait()
    out["stall_s"], _ = timed(lambda: ckpt.save(s + 1, state, data_iter, {}))
    ckpt.wait()
    out["sync_save_s"], _ = timed(lambda: (ckpt.save(s + 2, state, data_iter, {}), ckpt.wait()))
    return out


def with_ratios(row: dict) -> dict:
    """`row` (with the `LOCAL_KEYS`) plus stall_pct and the save / restore ratios to raw I/O."""
    return dict(
        row,
        stall_pct=100.0 * row["stall_s"] / row["sync_save_s"],
        save_vs_raw_write=row["save_s"] / row["raw_write_s"],
        restore_vs_raw_read=row["restore_s"] / row["raw_read_s"],
    )


def scale_table(sizes_mib: list[int] | None, workdir: str, repeats: int = 1) -> list[dict]:
    """The local measurements for each state size in `sizes_mib` (default `DEFAULT_SIZES`).

    Each size gets a fresh local `Checkpoints` under `workdir` (keep_last=3, so at most three
    steps of one size are on disk) whose files are deleted before the next size; the state and
    everything restored are freed between sizes. With ``repeats > 1`` each time is the median of
    the rounds (later rounds' saves also include Orbax deleting a step beyond keep_last, in the
    background, as in training).

    Returns one dict a size: ``mib``, ``repeats``, the `LOCAL_KEYS` times (s), ``stall_pct``
    (100 * stall_s / sync_save_s), ``save_vs_raw_write`` and ``restore_vs_raw_read``.
    """
    from prefect_jax.training.checkpoints import Checkpoints
    from prefect_jax.training.specs import CheckpointSpec
    from prefect_jax.training.trees import state_fingerprint

    sizes = list(sizes_mib or DEFAULT_SIZES)
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    os.makedirs(workdir, exist_ok=True)
    rows = []
    for mib in sizes:
        size_dir = tempfile.mkdtemp(prefix=f"scale-{mib}mib-", dir=workdir)
        state, abstract = make_state(mib)
        fingerprint = state_fingerprint(state)
        data_iter = make_data_iter()
        ckpt = Checkpoints(
            os.path.join(size_dir, "checkpoints"), CheckpointSpec(every_steps=1, keep_last=3)
        )
        try:
            rounds = [
                local_round(
                    ckpt,
                    state,
                    abstract,
                    data_iter,
                    1 + 3 * r,
                    os.path.join(size_dir, "raw.npy"),
                    fingerprint,
                )
                for r in range(repeats)
            ]
        finally:
            ckpt.close()
            shutil.rmtree(size_dir, ignore_errors=True)
        del state, abstract, data_iter, ckpt
        gc.collect()
        row = {"mib": mib, "repeats": repeats}
        row.update({k: statistics.median(r[k] for r in rounds) for k in LOCAL_KEYS})
        row = with_ratios(row)
        rows.append(row)
        log(
            f"{mib} MiB: save {row['save_s']:.3f}s, stall {row['stall_s']:.4f}s "
            f"({row['stall_pct']:.1f}% of sync save {row['sync_save_s']:.3f}s), "
            f"restore {row['restore_s']:.3f}s"
        )
    return rows


_COLUMNS = (  # (header, key, format)
    ("state MiB", "mib", "{}"),
    ("save s", "save_s", "{:.3f}"),
    ("sync save s", "sync_save_s", "{:.3f}"),
    ("stall s", "stall_s", "{:.4f}"),
    ("stall % of sync", "stall_pct", "{:.1f}"),
    ("restore s", "restore_s", "{:.3f}"),
    ("raw write s", "raw_write_s", "{:.3f}"),
    ("raw read s", "raw_read_s", "{:.3f}"),
    ("save / raw write", "save_vs_raw_write", "{:.2f}"),
    ("restore / raw read", "restore_vs_raw_read", "{:.2f}"),
)


def scale_markdown(rows: list[dict]) -> str:
    """The rows of `scale_table` as a markdown table (no trailing newline)."""
    lines = [
        "| " + " | ".join(h for h, _, _ in _COLUMNS) + " |",
        "|" + "|".join("---:" for _ in _COLUMNS) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in _COLUMNS) + " |")
    return "\n".join(lines)


def _rounded(d: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def run_scale(sizes: list[int], repeats: int) -> None:
    work = tempfile.mkdtemp(prefix="prefect-jax-storage-scale-")
    try:
        rows = scale_table(sizes, work, repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(scale_markdown(rows), file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "benchmark": "storage_scale",
                "rows": [_rounded(r) for r in rows],
                "machine": machine(),
            }
        )
    )


def run_single(mib: int) -> None:
    sys.path.insert(0, TESTS)
    from s3_server import S3Server, isolate_aws_env

    from prefect_jax.training.checkpoints import Checkpoints
    from prefect_jax.training.remote import RemoteSteps
    from prefect_jax.training.specs import CheckpointSpec
    from prefect_jax.training.trees import state_fingerprint

    isolate_aws_env()
    work = tempfile.mkdtemp(prefix="prefect-jax-storage-")
    state, abstract = make_state(mib)
    fingerprint = state_fingerprint(state)
    data_iter = make_data_iter()
    spec = CheckpointSpec(every_steps=1, keep_last=None)
    result: dict = {"mib": mib}

    # -- local ---------------------------------------------------------------------------------
    local = Checkpoints(os.path.join(work, "local"), spec)
    raw_path = os.path.join(work, "raw.npy")
    t = local_round(local, state, abstract, data_iter, 1, raw_path, fingerprint, keep_raw=True)
    result.update(
        local_save_s=t["save_s"],
        local_restore_s=t["restore_s"],
        raw_write_s=t["raw_write_s"],
        raw_read_s=t["raw_read_s"],
        async_save_call_s=t["stall_s"],
        sync_save_s=t["sync_save_s"],
    )
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
        assert state_fingerprint(restored) == fingerprint
        del restored
        result["s3_restore_total_s"] = result["s3_download_s"] + t_restore
        fs = s3.filesystem()
        result["raw_put_s"], _ = timed(lambda: fs.put_file(raw_path, "bench/raw.npy"))
        result["raw_get_s"], _ = timed(
            lambda: fs.get_file("bench/raw.npy", os.path.join(work, "raw-back.npy"))
        )
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
        machine=machine(),
    )
    print(json.dumps(r))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    parser.add_argument("--scale", action="store_true", help="sweep state sizes (local disk only)")
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",") if x.strip()],
        default=None,
        help=f"comma-separated MiB sizes for --scale (default {','.join(map(str, DEFAULT_SIZES))})",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds a size for --scale (median; default 1)"
    )
    args = parser.parse_args(argv)
    if args.sizes is not None and not args.scale:
        parser.error("--sizes needs --scale")
    if args.scale:
        run_scale(args.sizes or DEFAULT_SIZES, args.repeats)
    else:
        run_single(args.mib)


if __name__ == "__main__":
    main()
