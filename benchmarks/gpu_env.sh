# Sourced by the scripts run on a lent GPU machine (gpu_check.sh, lm_gpu.sh): the repo root as the
# working folder, OUT/PY/PLATFORM defaults, the wheels of benchmarks/gpu_wheels.sh unpacked (unless
# SKIP_WHEELS is set: a local try on the CPU), and the stack's versions printed. `stamp` prefixes a
# line with the seconds since the start and $STAMP_NAME.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PY:-python3}
PLATFORM=${PLATFORM:-cuda}
export PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false GIT_PYTHON_REFRESH=quiet
t0=$(date +%s)
stamp() { echo "[${STAMP_NAME:-gpu} +$(($(date +%s) - t0))s] $*"; }

if [ -z "${SKIP_WHEELS:-}" ]; then
  mkdir -p /tmp/site && tar -xJf .whl/site.tar.xz -C /tmp/site || exit 3
  export PYTHONPATH=/tmp/site:$PWD
  stamp "packages unpacked"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
$PY -c "
import jax, flax, optax, orbax.checkpoint as ocp, grain, array_record, prefect, mlflow, sys
print('python', sys.version.split()[0], '| jax', jax.__version__, jax.devices(), '| flax', flax.__version__,
      '| optax', optax.__version__, '| orbax', ocp.__version__, '| prefect', prefect.__version__,
      '| mlflow', mlflow.__version__)" || exit 4
