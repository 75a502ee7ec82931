#!/usr/bin/env bash
# prefect-jax on a lent GPU machine, in one device call (a few minutes):
#
#   benchmarks/gpu_wheels.sh                      # here: .whl/site.tar.xz (Prefect, MLflow, Grain, ...)
#   device run: bash benchmarks/gpu_check.sh      # carry [".whl"]; results come back from $OUT
#
# 1. The README's first command (`prefect-jax demo`: ephemeral Prefect, SQLite MLflow, local
#    checkpoints) with JAX on the GPU (JAX_PLATFORMS=cuda: no silent CPU fallback) and MLflow's
#    system metrics on; then what it left: the run's GPU metrics, the export's platforms, and the
#    registered model served by `mlflow.pyfunc` in a CPU-only process.
# 2. benchmarks/gpu.py: the engine against a plain jit + Orbax loop, and exact resume with donation.
# 3. The tests that kill real processes, count compiles and train through the flow, on the GPU.
# Here, to try the script itself on the CPU: SKIP_WHEELS=1 PY=.venv/bin/python PLATFORM=cpu benchmarks/gpu_check.sh
STAMP_NAME=gpu-check
source "$(dirname "$0")/gpu_env.sh"

# 1. The demo on the GPU.
demo=$(mktemp -d)
stamp "demo: start"
( cd "$demo" && export JAX_PLATFORMS=$PLATFORM MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=true MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL=1 \
    PYTHONPATH=${PYTHONPATH:-}:$OLDPWD && time $PY -m prefect_jax.cli demo ) >"$OUT/demo.log" 2>&1
rc=$?
stamp "demo: rc=$rc"
grep -v -E "^\s*$" "$OUT/demo.log" | tail -25
JAX_PLATFORMS=cpu $PY - "$demo/prefect-jax-demo" <<'EOF' 2>&1 | tee "$OUT/demo_check.txt"
import glob, json, os, subprocess, sys
import mlflow
from mlflow.tracking import MlflowClient
work = sys.argv[1]
uri = f"sqlite:///{work}/mlflow.db"
client = MlflowClient(uri)
runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
run = max(runs, key=lambda r: r.info.start_time)
keys = sorted(run.data.metrics)
print("run", run.info.run_id, run.info.status, "| metrics:", len(keys))
print("system gpu metrics:", [k for k in keys if k.startswith("system/gpu")][:8])
print("eval/accuracy", run.data.metrics.get("eval/accuracy"), "| goodput/goodput", run.data.metrics.get("goodput/goodput"))
print("trained on (tag prefect_jax.devices):", run.data.tags.get("prefect_jax.devices"))
exports = sorted(glob.glob(f"{work}/storage/*/exports/*/*/model.jax_export"))
print("exports:", len(exports))
import jax
print("export platforms:", jax.export.deserialize(bytearray(open(exports[-1], "rb").read())).platforms)
models = client.search_registered_models()
for m in models:
    print("registered", m.name, {a: v for a, v in (m.aliases or {}).items()})
name = models[0].name
serve = f"""
import sys; sys.modules["prefect_jax"] = None
import jax, mlflow, numpy as np
mlflow.set_tracking_uri({uri!r})
info = mlflow.models.get_model_info("models:/{name}@best")
model = mlflow.pyfunc.load_model("models:/{name}@best")
print("served on", jax.devices(), "platforms", info.metadata["prefect_jax"]["platforms"], "->", model.predict(np.zeros((3, 64), np.float32)).shape)
"""
proc = subprocess.run([sys.executable, "-c", serve], capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
print("cpu serving:", proc.stdout.strip() or proc.stderr[-1500:])
EOF
stamp "demo checked"

# Where the demo's start-up goes here (12.4 s of its 19.4 s on an H200, 2026-11-26, against ~5.7 s
# on 2 CPUs): each piece in a fresh process, then the demo again in a new workdir with warm caches.
JAX_PLATFORMS=$PLATFORM $PY - <<'EOF' 2>&1 | tee "$OUT/startup.txt"
import subprocess, sys, time
for label, code in [("python", "pass"), ("import jax", "import jax"), ("JAX client start", "import jax; jax.devices()"),
                    ("import prefect_jax.flows", "import prefect_jax.flows"), ("import mlflow", "import mlflow")]:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    print(f"start-up: {label}: {time.perf_counter() - began:.2f} s")
EOF
again=$(mktemp -d)
( cd "$again" && export JAX_PLATFORMS=$PLATFORM PYTHONPATH=${PYTHONPATH:-}:$OLDPWD && $PY -m prefect_jax.cli demo ) 2>&1 |
  grep -E "^ +goodput:" | sed 's/^ */start-up: the demo again: /' | tee -a "$OUT/startup.txt"
stamp "start-up timed"

# 2. The engine against a plain loop (and exact resume with donation).
JAX_PLATFORMS=$PLATFORM $PY benchmarks/gpu.py ${GPU_ARGS:-} --out "$OUT/gpu.json" 2>&1 | grep "^\[gpu\]"
stamp "gpu.py done"

# 3. Tests on the GPU. The tests run several JAX processes at once on the one GPU: no preallocation.
# Left out: the S3 tests (no moto or s3fs there) and the one that serves a model with no PYTHONPATH.
JAX_PLATFORMS=$PLATFORM XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TESTS_TIMEOUT:-240}" $PY -m pytest -q -p no:cacheprovider -rs \
  ${TESTS:-tests/test_preemption.py tests/test_compiles.py tests/test_registry.py tests/test_steps_per_dispatch.py tests/test_flow.py tests/test_export.py} \
  -k "not object_storage and not storage_block and not fresh_process and not where_the_cache_is" --durations=8 2>&1 | tee "$OUT/tests.log" | tail -25
stamp "tests done"
