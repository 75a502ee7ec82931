#!/usr/bin/env bash
# The byte-level LM benchmark (benchmarks/lm.py) on a lent GPU machine, in one device call:
#
#   benchmarks/gpu_wheels.sh                   # here: .whl/site.tar.xz (Prefect, MLflow, Grain, ...)
#   device run: bash benchmarks/lm_gpu.sh      # carry [".whl"]; $OUT/lm.json, lm.log, stacks.txt return
#
# The gpu100m preset (over 100M parameters, bfloat16 compute on float32 master weights): the
# flow and the bare loop, --steps steps each with a checkpoint every --checkpoint-every, sized to
# end within the call with its compiles. SIDES (which sides, in order: e.g. flow,bare_nosave,bare),
# STEPS, EVERY, LM_CONFIG (JSON overrides of the preset, e.g. '{"attention": "cudnn"}') and
# PEAK_TFLOPS change it; LM_TIMEOUT bounds the run. Each side takes STEPS times the step time
# (BENCHMARKS.md, "The byte-level LM on a GPU") plus its compiles: size STEPS to the lease.
# Here, to try the script itself on the CPU:
#   SKIP_WHEELS=1 PY=.venv/bin/python PLATFORM=cpu PRESET=tiny STEPS=60 EVERY=20 benchmarks/lm_gpu.sh
STAMP_NAME=lm-gpu
source "$(dirname "$0")/gpu_env.sh"

# The corpus (the standard library's sources) is built under a fresh cache: its build is timed
# in the JSON (corpus_s), outside the sides' clocks.
export PREFECT_JAX_CACHE_DIR=${PREFECT_JAX_CACHE_DIR:-$(mktemp -d)}
flags=(--preset "${PRESET:-gpu100m}" --sides "${SIDES:-bare_nosave,bare,flow}"
       --steps "${STEPS:-300}" --checkpoint-every "${EVERY:-100}"
       --config "${LM_CONFIG:-{\}}" --out "$OUT/lm.json" --stacks "$OUT/stacks.txt")
[ -n "${PEAK_TFLOPS:-}" ] && flags+=(--peak-tflops "$PEAK_TFLOPS")
stamp "lm.py: start"
JAX_PLATFORMS=$PLATFORM timeout "${LM_TIMEOUT:-330}" $PY benchmarks/lm.py "${flags[@]}" >"$OUT/lm.log" 2>&1
rc=$?
grep -E "^\[lm\]|Error|error:" "$OUT/lm.log" | tail -20
stamp "lm.py: rc=$rc"
[ -f "$OUT/lm.json" ] && cat "$OUT/lm.json"
exit $rc
