#!/usr/bin/env bash
# One GPU session in one call: build the package with its CUDA extension, run the GPU tests, the
# kernel benchmark, the main job and the end-to-end benchmark, and pack every log and result into
# $OUT/session.tgz (the device tool brings back at most 8 files). Run from the repository root:
#
#   STAGES="build tests kernel main" OUT=/tmp/out bash benchmarks/gpu_session.sh
#
# Stages (in this order, each optional): build tests loopback profile ncu fixedcost kernel mp
# smtax breakdown main e2e attention decode prefill (mp: one process per GPU, the multi-process
# tests and MP_KERNEL_ARGS through python -m jax_tokenweave.launch; compare with the kernel
# stage's single process; attention: paged attention per layer, xla / cuda / pallas, vs the
# copy bandwidth; decode: the serving engine's decode step vs the memory roofline; prefill: the
# engine's prefill steps vs the bare stack; all three on one GPU, Llama-3-8B shapes by default).
# Knobs: TESTS (pytest paths), TEST_RUNS, LOOPBACK_ARGS, PROFILE_ARGS, NCU_TOKENS, KERNEL_ARGS,
# SMTAX_ARGS, BREAKDOWN_ARGS, MAIN_ARGS, E2E_ARGS, ATTENTION_ARGS, DECODE_ARGS, PREFILL_ARGS
# (default: each benchmark's GPU defaults, attention within 300 s; e.g. ATTENTION_ARGS=--quick),
# per-stage time limits T_TESTS, T_KERNEL, T_MAIN, T_E2E, T_ATTENTION, T_DECODE, T_PREFILL
# (seconds; the last three default to 420: a device call ends at 10 minutes, so run the full
# attention, decode and prefill stages in separate calls); the last three stages write
# attention/, decode/ and prefill/ (JSON, markdown, plot) and their logs; JAX_TOKENWEAVE_COMMIT
# names the commit the copy was made from (the
# device machine gets no .git).
# Never touches NCCL_NVLS_ENABLE and never sets JAX_TOKENWEAVE_MULTIMEM: no multicast here.
set -u -o pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$repo/gpu_out}
STAGES=${STAGES:-build tests kernel main}
TESTS=${TESTS:-tests/test_ffi.py tests/test_loopback_gpu.py tests/test_cmdbuffer_gpu.py tests/test_ffi_gpu.py}
LOOPBACK_ARGS=${LOOPBACK_ARGS:---ranks 2 4 8 --tokens 1 16 64 256}
PROFILE_ARGS=${PROFILE_ARGS:---tokens 1 16 64 256}
KERNEL_ARGS=${KERNEL_ARGS:---tp 2 4 --hidden 8192 --tokens 1 16 64 256 1024 4096 16384 --ctas 16 32 64 128 --algos one_shot direct two_shot --reps 10 --device-time}
SMTAX_ARGS=${SMTAX_ARGS:---tokens 4096 8192 16384 --ctas 8 16 32}
BREAKDOWN_ARGS=${BREAKDOWN_ARGS:---model llama3-70b --layers 8 --tokens 1024 2048 4096 8192 16384 --ctas 8 16 32}
MAIN_ARGS=${MAIN_ARGS:---model llama3-70b --layers 4 --tokens 2048 8192 --collective xla --iters 10}
E2E_ARGS=${E2E_ARGS:---models llama3-70b --tp 4 --tokens 2048 8192 --layers 8 --iters 5}
ATTENTION_ARGS=${ATTENTION_ARGS:---time-budget 300}
DECODE_ARGS=${DECODE_ARGS:-}
PREFILL_ARGS=${PREFILL_ARGS:-}
W=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$SECONDS
# Each stage's log line first packs what the stages before it wrote, so a call cut off by its
# time limit still brings back every finished stage.
pack() { tar czf "$OUT/session.tgz" -C "$W" . 2>/dev/null; }
log() { pack; echo "[gpu_session $((SECONDS - start))s] $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
# -P: never import the source folder in place of the installed package.
PY="python3 -P"

{
  date -u; nvidia-smi -L; nvidia-smi topo -m
  env | grep -E 'NVLS|MULTICAST|JAX_TOKENWEAVE|CUDA_VISIBLE|CUDA_MODULE' | sort
  python3 -c 'import jax, sys; print(sys.version, jax.__version__, jax.devices())'
} > "$W/env.log" 2>&1
cat "$W/env.log"

status=0
if has build; then
  log "build"
  if ! (cd "$repo" && python3 -m pip install -v --no-build-isolation --no-deps -e .) \
      > "$W/build.log" 2>&1; then
    log "editable install failed; trying a plain install"
    (cd "$repo" && python3 -m pip install -v --no-build-isolation --no-deps .) \
      >> "$W/build.log" 2>&1 || { tail -40 "$W/build.log"; log "BUILD FAILED"; status=1; }
  fi
  $PY -c 'from jax_tokenweave.kernel import _ffi; print("extension:", _ffi.import_error() or "loaded")'
fi
if has tests && [[ $status == 0 ]]; then
  # TEST_RUNS consecutive runs of the same files (flaky waits show up as a failed run).
  for run in $(seq 1 "${TEST_RUNS:-1}"); do
    log "tests (run $run of ${TEST_RUNS:-1}): $TESTS"
    # shellcheck disable=SC2086
    (cd "$repo" && timeout ${T_TESTS:-300} $PY -m pytest -q -rfEs --durations=5 -p no:cacheprovider \
      $TESTS) > "$W/tests_$run.log" 2>&1 || status=$?
    tail -15 "$W/tests_$run.log"
  done
fi
if has loopback; then
  log "loopback benchmark: $LOOPBACK_ARGS"
  # shellcheck disable=SC2086
  timeout ${T_LOOPBACK:-120} $PY "$repo/benchmarks/loopback_bench.py" --out "$W/loopback" \
    $LOOPBACK_ARGS > "$W/loopback.log" 2>&1 || status=$?
  tail -40 "$W/loopback.log"
fi
if has profile; then
  log "profiled device time: $PROFILE_ARGS"
  # shellcheck disable=SC2086
  timeout ${T_PROFILE:-200} $PY "$repo/benchmarks/profile_kernels.py" --out "$W/profile" \
    $PROFILE_ARGS > "$W/profile.log" 2>&1 || status=$?
  tail -12 "$W/profile.log"
fi
if has ncu; then
  # Nsight Compute on one fused call per size (N = 1 unless NCU_TP): duration, stall reasons
  # and the per-line source view, exported to CSV (ncu is on the GPU image, not on CPU boxes).
  for t in ${NCU_TOKENS:-1 16 64}; do
    log "ncu: fused kernel at T=$t"
    rep="$W/ncu/fused_t$t"
    mkdir -p "$W/ncu"
    timeout ${T_NCU:-150} ncu --clock-control none --set full --import-source yes \
      --kernel-name regex:'OneShot|Fused|TwoShot|Direct|LocalRows' --launch-skip 8 --launch-count 1 \
      -f -o "$rep" $PY "$repo/benchmarks/ncu_fused.py" --tp "${NCU_TP:-1}" --tokens "$t" \
      > "$rep.log" 2>&1 || status=$?
    ncu -i "$rep.ncu-rep" --page details --csv > "$rep.details.csv" 2>> "$rep.log"
    ncu -i "$rep.ncu-rep" --page source --csv --print-source cuda,sass > "$rep.source.csv" \
      2>> "$rep.log"
    tail -3 "$rep.log"
    grep -E '"(Duration|Elapsed Cycles|Registers Per Thread|Achieved Occupancy)"' \
      "$rep.details.csv" | cut -d, -f12- | head -8
  done
fi
if has fixedcost; then
  log "fixed cost of the fused kernel's ingredients (benchmarks/fixed_cost)"
  nvcc -O3 -std=c++17 -arch=sm_90a -I "$repo/ffi" "$repo/benchmarks/fixed_cost/fixed_cost.cu" \
    -o "$W/fixed_cost" > "$W/fixed_cost.log" 2>&1 && timeout ${T_FIXEDCOST:-120} "$W/fixed_cost" \
    > "$W/fixed_cost.md" 2>> "$W/fixed_cost.log" || status=$?
  cat "$W/fixed_cost.md"; tail -3 "$W/fixed_cost.log"
fi
if has kernel; then
  log "kernel benchmark: $KERNEL_ARGS"
  # shellcheck disable=SC2086
  timeout ${T_KERNEL:-200} $PY "$repo/benchmarks/kernel_bench.py" --out "$W/kernel" $KERNEL_ARGS \
    > "$W/kernel.log" 2>&1 || status=$?
  cat "$W/kernel/kernel_bench.md" 2>/dev/null || tail -20 "$W/kernel.log"
fi
if has mp; then
  log "one process per GPU (${MP_N:-2} processes): tests and the kernel benchmark"
  (cd "$repo" && timeout ${T_MP:-300} $PY -m pytest -q -rfEs -p no:cacheprovider \
    tests/test_multiprocess_gpu.py) > "$W/mp_tests.log" 2>&1 || status=$?
  tail -3 "$W/mp_tests.log"
  # shellcheck disable=SC2086
  timeout ${T_MP:-300} $PY -m jax_tokenweave.launch -n "${MP_N:-2}" -- $PY \
    "$repo/benchmarks/kernel_bench.py" --out "$W/kernel_mp" \
    ${MP_KERNEL_ARGS:---tp 2 --hidden 8192 --tokens 1 128 1024 16384 --ctas 16 --impls ffi xla --reps 10} \
    > "$W/kernel_mp.log" 2>&1 || status=$?
  cat "$W/kernel_mp/kernel_bench.md" 2>/dev/null || tail -20 "$W/kernel_mp.log"
fi
if has smtax; then
  log "SM tax: $SMTAX_ARGS"
  # shellcheck disable=SC2086
  timeout ${T_SMTAX:-200} $PY "$repo/benchmarks/sm_tax.py" --out "$W/smtax" $SMTAX_ARGS \
    > "$W/smtax.log" 2>&1 || status=$?
  tail -12 "$W/smtax.log"
fi
if has breakdown; then
  log "breakdown: $BREAKDOWN_ARGS"
  # shellcheck disable=SC2086
  timeout ${T_BREAKDOWN:-400} $PY "$repo/benchmarks/breakdown.py" --out "$W/breakdown" \
    $BREAKDOWN_ARGS > "$W/breakdown.log" 2>&1 || status=$?
  cat "$W/breakdown/breakdown.md" 2>/dev/null || tail -20 "$W/breakdown.log"
fi
if has main; then
  log "main job: $MAIN_ARGS"
  # shellcheck disable=SC2086
  (cd "$W" && timeout ${T_MAIN:-180} $PY -m jax_tokenweave.bench --no-progress --json "$W/bench.json" \
    --plot "$W/bench.png" $MAIN_ARGS) > "$W/bench.txt" 2>&1 || status=$?
  tail -20 "$W/bench.txt"
fi
if has e2e; then
  log "e2e benchmark: $E2E_ARGS"
  # shellcheck disable=SC2086
  timeout ${T_E2E:-300} $PY "$repo/benchmarks/e2e_bench.py" --out "$W/e2e" $E2E_ARGS \
    > "$W/e2e.txt" 2>&1 || status=$?
  cat "$W/e2e/e2e.md" 2>/dev/null || tail -30 "$W/e2e.txt"
fi
for bench in attention decode prefill; do
  has "$bench" || continue
  args_var="${bench^^}_ARGS"; limit_var="T_${bench^^}"
  log "$bench benchmark: ${!args_var}"
  # shellcheck disable=SC2086
  timeout "${!limit_var:-420}" $PY "$repo/benchmarks/${bench}_bench.py" --out "$W/$bench" \
    ${!args_var} > "$W/$bench.log" 2>&1 || status=$?
  cat "$W/$bench/$bench.md" 2>/dev/null || tail -30 "$W/$bench.log"
done
log "done (status $status); results in $OUT/session.tgz"
exit "$status"
