#!/usr/bin/env bash
# The serving benchmark on GPUs in one command: install the package (building the CUDA
# extension), then run benchmarks/serve_bench.py (weave engine vs baseline engine, all-at-once
# and Poisson arrivals) and write serve.json / serve.md / serve.png into $OUT. From the
# repository root, on 2 x H200 (the issue's target: Llama-3.3-70B shapes, 8 layers, TP 2):
#
#   OUT=benchmarks/results/$(date +%F)-h200x2/serve bash benchmarks/gpu_serve.sh
#
# Knobs (environment variables, defaults in brackets):
#   OUT           output folder [./benchmarks/results/<date>-serve]
#   MODEL LAYERS  model config and decoder layers [llama3-70b, 8]
#   TP            tensor-parallel degree [2]
#   SERVE_ARGS    extra serve_bench.py arguments [""], e.g. "--num-requests 128 --rate 2"
#   SKIP_INSTALL  set to 1 to use the installed package as it is
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$repo/benchmarks/results/$(date +%Y%m%d-%H%M%S)-serve}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  (cd "$repo" && python3 -m pip install --no-build-isolation --no-deps .) > "$OUT/install.log" 2>&1 \
    || { tail -40 "$OUT/install.log"; exit 1; }
fi
# Outside the checkout, so Python imports the installed package (with its extension).
cd "$OUT"
# shellcheck disable=SC2086
python3 "$repo/benchmarks/serve_bench.py" --out "$OUT" --model "${MODEL:-llama3-70b}" \
  --layers "${LAYERS:-8}" --tp "${TP:-2}" ${SERVE_ARGS:-} 2>&1 | tee "$OUT/serve.txt"
