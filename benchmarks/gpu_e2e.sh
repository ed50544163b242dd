#!/usr/bin/env bash
# The GPU benchmark run: install the package (building the CUDA extension), run the main job and
# the end-to-end benchmark, and write everything into $OUT. Run from the repository root:
#
#   OUT=/tmp/out bash benchmarks/gpu_e2e.sh
#
# Knobs (environment variables, defaults in brackets):
#   OUT           output folder [./benchmarks/results/<date>]
#   MODELS        e2e models ["llama3-70b"]; e.g. "llama3-70b qwen2.5-72b mixtral-8x22b"
#   TPS           e2e TP degrees, in run order ["4 2"]
#   TOKENS        e2e prefill tokens ["1024 2048 4096 8192 16384"]
#   DECODE_TOKENS e2e decode batch sizes ["1 8 32 64 128 256"]
#   LAYERS        e2e decoder layers [8]
#   ITERS         timed runs per mode [10] (main job: [20])
#   E2E_BUDGET    seconds after which the e2e run starts no new measurement [200]
#   MAIN_ARGS     extra arguments for the main job [""]
#   SKIP_INSTALL  set to 1 to use the installed package as it is
# With the defaults the whole script takes about 6 minutes on 4 H200s.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$repo/benchmarks/results/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
MODELS=${MODELS:-llama3-70b}
TPS=${TPS:-4 2}
TOKENS=${TOKENS:-1024 2048 4096 8192 16384}
DECODE_TOKENS=${DECODE_TOKENS:-1 8 32 64 128 256}
LAYERS=${LAYERS:-8}
ITERS=${ITERS:-10}
E2E_BUDGET=${E2E_BUDGET:-200}
MAIN_ARGS=${MAIN_ARGS:-}
start=$SECONDS

log() { echo "[gpu_e2e $((SECONDS - start))s] $*"; }

{
  nvidia-smi || true
  nvidia-smi topo -m || true
  python3 --version
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
} > "$OUT/machine.txt" 2>&1 || true

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  log "installing the package (builds the CUDA extension where nvcc is found)"
  (cd "$repo" && python3 -m pip install --no-build-isolation --no-deps .) > "$OUT/install.log" 2>&1 \
    || { tail -40 "$OUT/install.log"; exit 1; }
fi

# Run outside the checkout so that Python imports the installed package (with its compiled
# extension), not the source folder.
cd "$OUT"
python3 -c "
from jax_tokenweave import _ffi, benchmarking
import jax, jax.numpy as jnp
devs = jax.devices()
mesh = benchmarking.make_mesh(devs, len(devs))
print('ffi:', _ffi.unavailable_reason(mesh, 'tp', jnp.bfloat16, (8192, 8192)) or 'available')
" 2>&1 | tee "$OUT/ffi.txt" || true

log "main job"
# shellcheck disable=SC2086
status=0
python3 -m jax_tokenweave.bench --no-progress --json "$OUT/bench.json" --plot "$OUT/bench.png" \
  $MAIN_ARGS 2>&1 | tee "$OUT/bench.txt" || { status=$?; log "main job failed ($status)"; }

log "end-to-end benchmark (budget ${E2E_BUDGET}s)"
# shellcheck disable=SC2086
python3 "$repo/benchmarks/e2e_bench.py" --out "$OUT" --models $MODELS --tp $TPS \
  --tokens $TOKENS --decode-tokens $DECODE_TOKENS --layers "$LAYERS" --iters "$ITERS" \
  --time-budget "$E2E_BUDGET" 2>&1 | tee "$OUT/e2e.txt" || { status=$?; log "e2e failed ($status)"; }

log "done; results in $OUT"
ls -l "$OUT"
exit "$status"
