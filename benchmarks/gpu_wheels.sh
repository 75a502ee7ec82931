#!/usr/bin/env bash
# Wheels for running prefect-jax (Prefect, MLflow, Grain and what they need) on a lent GPU machine
# whose image has Python 3.12, JAX with CUDA, Flax, optax and Orbax but no Prefect, MLflow or Grain,
# and no package registry. Run here, in the repo root; it fills .whl/ (ignored by git), which a
# device call carries and benchmarks/gpu_check.sh unpacks there. The versions are uv.lock's.
#
#   benchmarks/gpu_wheels.sh      # .whl/site.tar.xz: with the repo, under the call's 64 MiB
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)  # also in a worktree, where .git is a file
mkdir -p "$(dirname "$exclude")" && { grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"; }
rm -rf .whl && mkdir -p .whl

# The image's own packages (KINDS.md, 2026-11-17) are used as they are: the compute stack above all
# (jax, jaxlib, numpy, flax, optax, orbax-checkpoint, scipy, pandas, pyarrow, scikit-learn, ...).
on_image="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer chex click cloudpickle colorama contourpy coverage cycler etils flatbuffers flax fonttools
frozenlist fsspec grpcio h11 h5py httpcore httpx humanize idna jax jaxlib jinja2 joblib kiwisolver markdown
markdown-it-py markupsafe matplotlib mdurl ml-dtypes msgpack multidict narwhals numpy opt-einsum optax
orbax-checkpoint packaging pandas pathspec pillow pluggy prometheus-client propcache protobuf psutil pyarrow
pygments pyparsing python-dateutil pyyaml regex requests rich scikit-learn scipy shellingham simplejson six
tensorstore threadpoolctl treescope typer typing-extensions urllib3 uvloop werkzeug wrapt yarl zipp"
# ... except these, where Prefect, MLflow or pydantic need the locked version (small, pure Python).
from_lock="anyio httpx httpcore h11 click typer rich fsspec cloudpickle jinja2 markupsafe packaging werkzeug
typing-extensions aiofiles humanize prometheus-client pathspec markdown-it-py mdurl pyyaml shellingham orbax-checkpoint"
# Left out: S3 storage (botocore alone is 16 MiB) and Windows. (prefect.flows imports
# exceptiongroup on any Python, its server asyncpg; the image has orbax-checkpoint 0.12.4, the lock 0.12.8.)
skip="botocore aiobotocore s3fs jmespath aioitertools pywin32 async-timeout"

uv export --frozen --no-hashes --no-dev --no-emit-project | grep -E '^[A-Za-z0-9]' | sed 's/ ;.*//' >.whl/all.txt
: >.whl/req.txt
while IFS= read -r req; do
  name=$(echo "${req%%==*}" | tr 'A-Z_' 'a-z-')
  name=${name%%[*}
  case " $(echo $skip) " in *" $name "*) continue ;; esac
  case " $(echo $from_lock) " in *" $name "*) echo "$req" >>.whl/req.txt; continue ;; esac
  case " $(echo $on_image) " in *" $name "*) continue ;; esac
  echo "$req" >>.whl/req.txt
done <.whl/all.txt
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl -r .whl/req.txt 2>&1 | grep -v '^WARNING' || true
rm -f .whl/all.txt
# Unpacked (a wheel is a zip: pip's --target does little more) and packed again with xz: 63 MiB of
# wheels become ~38 MiB, which leaves room in the call's 64 MiB for the repo.
n=$(ls .whl/*.whl | wc -l)
site=$(mktemp -d)
for w in .whl/*.whl; do unzip -q -o "$w" -d "$site"; done
tar -C "$site" -cf - . | xz -T0 -6 >.whl/site.tar.xz
rm -rf "$site" .whl/*.whl
echo "$n wheels, $(du -sh .whl/site.tar.xz | cut -f1) packed"
