#!/usr/bin/env bash
# The serving benchmark on GPUs in one command: install the package (building the CUDA
# extension), then run benchmarks/serve_bench.py (weave engine vs baseline engine, each under
# the KV cache policies; all-at-once and Poisson arrivals unless SERVE_ARGS names --workloads
# chat / shared-prefix). From the repository root, on 2 x H200 (Llama-3.3-70B shapes, 8
# layers, TP 2):
#
#   OUT=/tmp/serve bash benchmarks/gpu_serve.sh
#
# $OUT/results/serve/ gets serve.json and serve.md (what benchmarks/results/<date>-<kind>/
# keeps, with the command in results/README.md); $OUT/logs/ the install log, the benchmark's
# output and serve.png. Logs never go into the tree: OUT inside benchmarks/results is refused.
#
# Knobs (environment variables, defaults in brackets):
#   OUT           output folder [./gpu_out/serve]
#   MODEL LAYERS  model config and decoder layers [llama3-70b, 8]
#   TP            tensor-parallel degree [2]
#   SERVE_ARGS    extra serve_bench.py arguments [""], e.g. "--num-requests 128 --rate 2" or
#                 "--workloads chat --policies on-demand reserve --gpu-memory-utilization 0.9"
#   SKIP_INSTALL  set to 1 to use the installed package as it is
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
OUT=$(realpath -m "${OUT:-$repo/gpu_out/serve}")
case "$OUT/" in
  "$repo/benchmarks/results/"*)
    echo "gpu_serve: OUT=$OUT is inside benchmarks/results: logs never go into the tree" >&2
    exit 2 ;;
esac
mkdir -p "$OUT/results/serve" "$OUT/logs"
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  (cd "$repo" && python3 -m pip install --no-build-isolation --no-deps .) > "$OUT/logs/install.log" 2>&1 \
    || { tail -40 "$OUT/logs/install.log"; exit 1; }
fi
args=(--model "${MODEL:-llama3-70b}" --layers "${LAYERS:-8}" --tp "${TP:-2}")
# shellcheck disable=SC2206
args+=(${SERVE_ARGS:-})
{
  echo "# Serving benchmark, $(date -u +%FT%TZ)"
  echo
  echo "- Device: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs)"
  echo "- Commit: ${JAX_TOKENWEAVE_COMMIT:-$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  echo "- Command: \`python3 benchmarks/serve_bench.py --out serve ${args[*]}\`"
} > "$OUT/results/README.md"
# Outside the checkout, so Python imports the installed package (with its extension).
cd "$OUT/logs"
status=0
python3 "$repo/benchmarks/serve_bench.py" --out "$OUT/results/serve" "${args[@]}" 2>&1 \
  | tee "$OUT/logs/serve.log" || status=$?
[[ -f "$OUT/results/serve/serve.png" ]] && mv "$OUT/results/serve/serve.png" "$OUT/logs/"
exit "$status"
