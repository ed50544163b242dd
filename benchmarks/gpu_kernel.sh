#!/usr/bin/env bash
# Build the extension, run the FFI tests and a short kernel benchmark on a GPU machine.
# Usage (device machine, repo root): bash benchmarks/gpu_kernel.sh [quick|full]
# Writes logs and results under $OUT (default ./gpu_out). Never touches NCCL_NVLS_ENABLE and
# never sets JAX_TOKENWEAVE_MULTIMEM: the multimem path is not run here.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu_out}
MODE=${1:-quick}
mkdir -p "$OUT/kernel"
export PYTHONUNBUFFERED=1 JAX_TOKENWEAVE_TIMEOUT_S=${JAX_TOKENWEAVE_TIMEOUT_S:-5}
PY=${PY:-python3}
{
  date -u; nvidia-smi -L; nvidia-smi topo -m
  env | grep -E 'NVLS|MULTICAST|JAX_TOKENWEAVE|CUDA_VISIBLE' | sort
  $PY -c 'import jax, sys; print(sys.version, jax.__version__, jax.devices())'
  nvcc --version | tail -1; cmake --version | head -1
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

echo "== build"
t0=$(date +%s)
if ! $PY -m pip install -v --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
SO=$(cd /tmp && $PY -c 'import jax_tokenweave._tokenweave_ffi as m; print(m.__file__)') || exit 1
cp "$SO" jax_tokenweave/  # so the source tree (cwd) also finds the built module
echo "built in $(( $(date +%s) - t0 )) s: $SO"

echo "== tests"
timeout 300 $PY -m pytest -q -rfEs --durations=8 -p no:cacheprovider \
  tests/test_ffi.py tests/test_ffi_gpu.py 2>&1 | tee "$OUT/tests.log" | tail -40

echo "== bench"
if [ "$MODE" = full ]; then
  ARGS=(--tokens 1 16 128 1024 4096 16384 --hidden 8192 5120 4096 --ctas 2 4 8 16 32)
else
  ARGS=(--tokens 1 16 128 1024 4096 16384 --hidden 8192 --ctas 4 8 16 32)
fi
timeout 240 $PY benchmarks/kernel_bench.py --out "$OUT/kernel" --tp 2 4 "${ARGS[@]}" --reps 15 \
  2>&1 | tee "$OUT/bench.log" | grep -v '^{' | tail -30
timeout 100 $PY benchmarks/kernel_bench.py --out "$OUT/algo" --tp 2 --hidden 8192 \
  --tokens 1 4 16 64 --impls ffi --algos one_shot two_shot --ctas 16 --reps 15 \
  2>&1 | grep -v '^{' | tail -20
cp "$OUT/algo/kernel_bench.json" "$OUT/kernel/algo_bench.json" 2>/dev/null; rm -rf "$OUT/algo"
echo "== done"
