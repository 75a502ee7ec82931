"""`benchmarks/lm_gpu.sh`, the one command a lent GPU machine runs for issue 52's item 3 (the byte
LM trained by the flow and by a bare JAX loop in one process), tried here on the CPU as its header
says: a lease is minutes, so a script that broke here would waste one. Four sides of a few steps of
the tiny preset; the JSON must hold each side's clocks and the ratios, and every side must end at
the same eval (same seed, data and steps), so a side that trained differently fails."""

import json
import os
import subprocess
import sys

import pytest
from process_helpers import BENCHMARKS_DIR

SIDES = ["bare_nosave", "bare", "flow", "flow_nocopy"]


@pytest.mark.slow
def test_the_gpu_script_on_the_cpu_times_every_side_and_they_end_at_the_same_eval(
    tmp_path, prefect_server
):
    env = dict(
        os.environ,
        SKIP_WHEELS="1",
        PY=sys.executable,
        PLATFORM="cpu",
        PRESET="tiny",
        STEPS="8",
        EVERY="4",
        SIDES=",".join(SIDES),
        OUT=str(tmp_path),
        LM_TIMEOUT="400",
        PREFECT_API_URL=prefect_server,  # the session's server, not an ephemeral one per side
    )
    done = subprocess.run(
        ["bash", os.path.join(BENCHMARKS_DIR, "lm_gpu.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    log = (tmp_path / "lm.log").read_text() if (tmp_path / "lm.log").exists() else ""
    assert done.returncode == 0, done.stdout[-2000:] + log[-3000:]
    out = json.loads((tmp_path / "lm.json").read_text())
    assert out["backend"] == "cpu" and out["preset"] == "tiny"
    assert out["steps"] == 8 and out["checkpoint_every"] == 4 and out["warmup"] == 2
    assert out["sync_save_s"] > 0 and out["peak_flops"] is None
    assert list(out["sides"]) == SIDES
    for name, side in out["sides"].items():
        assert side["loop_s"] > 0 and side["tokens_per_s"] > 0, name
        assert side["mfu"] is None, name  # no peak known for a CPU
        assert side["stretch_s"] > 0, name
        if name != "bare_nosave":
            assert "stall_share_of_sync_save" in side, name
    for ratio in ("loop_ratio", "tokens_per_s_ratio", "tokens_per_s_ratio_nocopy"):
        assert out[ratio] > 0, ratio
    assert out["same_eval"], out["eval_loss_spread"]
    assert (tmp_path / "stacks.txt").stat().st_size > 0  # the flow side's trainer thread
    assert (tmp_path / "stacks_nocopy.txt").stat().st_size > 0
