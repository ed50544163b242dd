#!/usr/bin/env bash
# One GPU session in one call: build the package with its CUDA extension, run the GPU tests and
# the benchmarks named in STAGES, and pack everything into $OUT/session.tgz (the device tool
# brings back few files). Run from the repository root:
#
#   STAGES="build tests kernel main" OUT=/tmp/out bash benchmarks/gpu_session.sh
#
# The archive holds two folders:
#   results/  what the tree keeps: per stage its JSON and markdown, and README.md with the
#             device, date, commit and every stage's command. Copy it into
#             benchmarks/results/<date>-<kind>/ (CONTRIBUTING.md, "Recording GPU results").
#   logs/     everything else: env.log, the build, every stage's output, plots, ncu reports.
#             Logs never go into the tree; OUT inside benchmarks/results is refused.
#
# Stages (in this order, each optional): build tests loopback profile ncu fixedcost kernel mp
# smtax breakdown ce main e2e attention decode prefill (ce: the breakdown with the copy-engine
# variant forced beside the tables' choice, profiled per kernel class; mp: one process per GPU,
# the multi-process tests and MP_KERNEL_ARGS through python -m jax_tokenweave.launch; compare with the kernel
# stage's single process; attention: paged attention per layer, xla / cuda / pallas, vs the
# copy bandwidth; decode: the serving engine's decode step vs the memory roofline; prefill: the
# engine's prefill steps vs the bare stack; all three on one GPU, Llama-3-8B shapes by default).
# Knobs: TESTS (pytest paths), TEST_RUNS, LOOPBACK_ARGS, PROFILE_ARGS, NCU_TOKENS, KERNEL_ARGS,
# SMTAX_ARGS, BREAKDOWN_ARGS, CE_ARGS, MAIN_ARGS, E2E_ARGS, ATTENTION_ARGS, DECODE_ARGS, PREFILL_ARGS
# (default: each benchmark's GPU defaults, attention within 300 s; e.g. ATTENTION_ARGS=--quick),
# per-stage time limits T_TESTS, T_KERNEL, T_CE, T_MAIN, T_E2E, T_ATTENTION, T_DECODE, T_PREFILL
# (seconds; the last three default to 420: a device call ends at 10 minutes, so run the full
# attention, decode and prefill stages in separate calls); JAX_TOKENWEAVE_COMMIT names the
# commit the copy was made from (the device machine gets no .git).
# Never touches NCCL_NVLS_ENABLE and never sets JAX_TOKENWEAVE_MULTIMEM: no multicast here.
set -u -o pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
OUT=${OUT:-$repo/gpu_out}
case "$(realpath -m "$OUT")/" in
  "$repo/benchmarks/results/"*)
    echo "gpu_session: OUT=$OUT is inside benchmarks/results: logs never go into the tree;" \
      "give a folder outside it and copy its results/ in" >&2
    exit 2 ;;
esac
STAGES=${STAGES:-build tests kernel main}
TESTS=${TESTS:-tests/test_ffi.py tests/test_loopback_gpu.py tests/test_cmdbuffer_gpu.py tests/test_ffi_gpu.py}
LOOPBACK_ARGS=${LOOPBACK_ARGS:---ranks 2 4 8 --tokens 1 16 64 256}
PROFILE_ARGS=${PROFILE_ARGS:---tokens 1 16 64 256}
KERNEL_ARGS=${KERNEL_ARGS:---tp 2 4 --hidden 8192 --tokens 1 16 64 256 1024 4096 16384 --ctas 16 32 64 128 --algos one_shot direct two_shot --reps 10 --device-time}
SMTAX_ARGS=${SMTAX_ARGS:---tokens 4096 8192 16384 --ctas 8 16 32}
BREAKDOWN_ARGS=${BREAKDOWN_ARGS:---model llama3-70b --layers 8 --tokens 1024 2048 4096 8192 16384 --ctas 8 16 32}
CE_ARGS=${CE_ARGS:---model llama3-70b --layers 8 --tokens 2048 4096 8192 16384 --modes baseline nocomm weave-local weave-ffi weave-auto --algos ce --ctas 16 32 --device-time 3}
MAIN_ARGS=${MAIN_ARGS:---model llama3-70b --layers 4 --tokens 2048 8192 --collective xla --iters 10}
E2E_ARGS=${E2E_ARGS:---models llama3-70b --tp 4 --tokens 2048 8192 --layers 8 --iters 5}
ATTENTION_ARGS=${ATTENTION_ARGS:---time-budget 300}
DECODE_ARGS=${DECODE_ARGS:-}
PREFILL_ARGS=${PREFILL_ARGS:-}
COMMIT=${JAX_TOKENWEAVE_COMMIT:-$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)}
W=$(mktemp -d)
R="$W/results"
L="$W/logs"
mkdir -p "$OUT" "$R" "$L"
export PYTHONUNBUFFERED=1
start=$SECONDS
# Each stage's log line first packs what the stages before it wrote, so a call cut off by its
# time limit still brings back every finished stage.
# Written aside and renamed: a call cut off mid-pack leaves the previous whole archive.
pack() { tar czf "$OUT/.session.tgz.part" -C "$W" . 2>/dev/null && mv -f "$OUT/.session.tgz.part" "$OUT/session.tgz"; }
log() { pack; echo "[gpu_session $((SECONDS - start))s] $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
# -P: never import the source folder in place of the installed package.
PY="python3 -P"

{
  date -u; nvidia-smi -L; nvidia-smi topo -m
  env | grep -E 'NVLS|MULTICAST|JAX_TOKENWEAVE|CUDA_VISIBLE|CUDA_MODULE' | sort
  python3 -c 'import jax, sys; print(sys.version, jax.__version__, jax.devices())'
} > "$L/env.log" 2>&1
cat "$L/env.log"

# results/README.md: the device, the date, the commit, then a row per stage with its command.
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)
count=$(grep -c . <<< "$gpus")
kind=$(head -1 <<< "$gpus" | grep -oiE '[ahb][0-9]{2,3}' | head -1 | tr '[:upper:]' '[:lower:]')
{
  echo "# GPU session $(date -u +%F)"
  echo
  echo "- Device: ${count} x $(head -1 <<< "$gpus" | sed 's/^$/no GPU/')"
  echo "- Date (UTC): $(date -u +%FT%TZ); commit: $COMMIT"
  echo "- Copy these folders into \`benchmarks/results/$(date -u +%F)-${kind:-cpu}x${count}/\` and say"
  echo "  there what the figures show. The logs are in session.tgz's \`logs/\`, not in the tree."
  echo
  echo "| stage | files | command (from the repository root) | exit status |"
  echo "|---|---|---|---|"
} > "$R/README.md"
# record STAGE STATUS COMMAND...: the stage's row in results/README.md.
record() { local stage=$1 rc=$2; shift 2; echo "| $stage | \`$stage/\` | \`$*\` | $rc |" >> "$R/README.md"; }
# tidy STAGE: results/STAGE keeps its JSON and markdown; plots and the rest go to logs/STAGE.
tidy() {
  [[ -d "$R/$1" ]] || return 0
  find "$R/$1" -type f ! -name '*.json' ! -name '*.md' -exec sh -c \
    'dst=$0 src=$1; shift; for f; do r=${f#"$src"/}; mkdir -p "$dst/$(dirname "$r")"; mv "$f" "$dst/$r"; done' \
    "$L/$1" "$R/$1" {} +
}
# bench STAGE LIMIT SCRIPT ARGS...: benchmarks/SCRIPT --out results/STAGE, its output in
# logs/STAGE.log; the markdown it wrote (or the log's tail) on stdout.
bench() {
  local stage=$1 limit=$2 script=$3 rc=0; shift 3
  log "$stage: $*"
  timeout "$limit" $PY "$repo/benchmarks/$script" --out "$R/$stage" "$@" > "$L/$stage.log" 2>&1 || rc=$?
  record "$stage" "$rc" "python3 -P benchmarks/$script --out $stage $*"
  tidy "$stage"
  cat "$R/$stage"/*.md 2>/dev/null || tail -30 "$L/$stage.log"
  return "$rc"
}
# tests_json FILE COMMAND LOG...: each log's pytest summary line as JSON (the logs stay out).
tests_json() {
  local file=$1 command=$2; shift 2
  mkdir -p "$(dirname "$file")"
  python3 - "$file" "$command" "$COMMIT" "$@" <<'EOF'
import json, re, sys
out, command, commit, *logs = sys.argv[1:]
runs = []
for log in logs:
    lines = [l for l in open(log, errors="replace").read().splitlines()
             if re.search(r"\d+ (passed|failed|errors?|skipped)", l)]
    runs.append(lines[-1].strip("= ") if lines else "no summary line: see the log")
json.dump({"command": command, "commit": commit, "runs": runs}, open(out, "w"), indent=1)
EOF
}

status=0
if has build; then
  log "build"
  if ! (cd "$repo" && python3 -m pip install -v --no-build-isolation --no-deps -e .) \
      > "$L/build.log" 2>&1; then
    log "editable install failed; trying a plain install"
    (cd "$repo" && python3 -m pip install -v --no-build-isolation --no-deps .) \
      >> "$L/build.log" 2>&1 || { tail -40 "$L/build.log"; log "BUILD FAILED"; status=1; }
  fi
  $PY -c 'from jax_tokenweave.kernel import _ffi; print("extension:", _ffi.import_error() or "loaded")'
fi
if has tests && [[ $status == 0 ]]; then
  # TEST_RUNS consecutive runs of the same files (flaky waits show up as a failed run).
  command="python3 -P -m pytest -q -rfEs --durations=5 -p no:cacheprovider $TESTS"
  for run in $(seq 1 "${TEST_RUNS:-1}"); do
    log "tests (run $run of ${TEST_RUNS:-1}): $TESTS"
    # shellcheck disable=SC2086
    (cd "$repo" && timeout ${T_TESTS:-300} $PY -m pytest -q -rfEs --durations=5 -p no:cacheprovider \
      $TESTS) > "$L/tests_$run.log" 2>&1 || status=$?
    tail -15 "$L/tests_$run.log"
  done
  tests_json "$R/tests/gpu_tests.json" "$command, ${TEST_RUNS:-1} run(s)" "$L"/tests_*.log
  record tests "$status" "$command"
fi
# shellcheck disable=SC2086
has loopback && { bench loopback "${T_LOOPBACK:-120}" loopback_bench.py $LOOPBACK_ARGS || status=$?; }
# shellcheck disable=SC2086
has profile && { bench profile "${T_PROFILE:-200}" profile_kernels.py $PROFILE_ARGS || status=$?; }
if has ncu; then
  # Nsight Compute on one fused call per size (N = 1 unless NCU_TP): duration, stall reasons
  # and the per-line source view, exported to CSV (ncu is on the GPU image, not on CPU boxes).
  # Profiler dumps stay in logs/ncu.
  for t in ${NCU_TOKENS:-1 16 64}; do
    log "ncu: fused kernel at T=$t"
    rep="$L/ncu/fused_t$t"
    mkdir -p "$L/ncu"
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
  mkdir -p "$R/fixedcost"
  rc=0
  nvcc -O3 -std=c++17 -arch=sm_90a -I "$repo/ffi" "$repo/benchmarks/fixed_cost/fixed_cost.cu" \
    -o "$W/fixed_cost" > "$L/fixedcost.log" 2>&1 && timeout ${T_FIXEDCOST:-120} "$W/fixed_cost" \
    > "$R/fixedcost/fixed_cost.md" 2>> "$L/fixedcost.log" || rc=$?
  record fixedcost "$rc" "nvcc -O3 -std=c++17 -arch=sm_90a -I ffi benchmarks/fixed_cost/fixed_cost.cu -o fixed_cost && ./fixed_cost > fixed_cost.md"
  [[ $rc == 0 ]] || status=$rc
  cat "$R/fixedcost/fixed_cost.md"; tail -3 "$L/fixedcost.log"
fi
# shellcheck disable=SC2086
has kernel && { bench kernel "${T_KERNEL:-200}" kernel_bench.py $KERNEL_ARGS || status=$?; }
if has mp; then
  log "one process per GPU (${MP_N:-2} processes): tests and the kernel benchmark"
  (cd "$repo" && timeout ${T_MP:-300} $PY -m pytest -q -rfEs -p no:cacheprovider \
    tests/test_multiprocess_gpu.py) > "$L/mp_tests.log" 2>&1 || status=$?
  tail -3 "$L/mp_tests.log"
  tests_json "$R/mp_tests/gpu_tests.json" \
    "python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_multiprocess_gpu.py" "$L/mp_tests.log"
  mp_args=${MP_KERNEL_ARGS:---tp 2 --hidden 8192 --tokens 1 128 1024 16384 --ctas 16 --impls ffi xla --reps 10}
  rc=0
  # shellcheck disable=SC2086
  timeout ${T_MP:-300} $PY -m jax_tokenweave.launch -n "${MP_N:-2}" -- $PY \
    "$repo/benchmarks/kernel_bench.py" --out "$R/kernel_mp" $mp_args > "$L/kernel_mp.log" 2>&1 || rc=$?
  record kernel_mp "$rc" "python3 -P -m jax_tokenweave.launch -n ${MP_N:-2} -- python3 -P benchmarks/kernel_bench.py --out kernel_mp $mp_args"
  tidy kernel_mp
  [[ $rc == 0 ]] || status=$rc
  cat "$R/kernel_mp/kernel_bench.md" 2>/dev/null || tail -20 "$L/kernel_mp.log"
fi
# shellcheck disable=SC2086
has smtax && { bench smtax "${T_SMTAX:-200}" sm_tax.py $SMTAX_ARGS || status=$?; }
# shellcheck disable=SC2086
has breakdown && { bench breakdown "${T_BREAKDOWN:-400}" breakdown.py $BREAKDOWN_ARGS || status=$?; }
# shellcheck disable=SC2086
has ce && { bench ce "${T_CE:-420}" breakdown.py $CE_ARGS || status=$?; }
if has main; then
  log "main job: $MAIN_ARGS"
  mkdir -p "$R/main" "$L/main"
  rc=0
  # shellcheck disable=SC2086
  (cd "$W" && timeout ${T_MAIN:-180} $PY -m jax_tokenweave.bench --no-progress \
    --json "$R/main/bench.json" --plot "$L/main/bench.png" $MAIN_ARGS) > "$L/main.log" 2>&1 || rc=$?
  record main "$rc" "python3 -P -m jax_tokenweave.bench --no-progress --json main/bench.json $MAIN_ARGS"
  [[ $rc == 0 ]] || status=$rc
  tail -20 "$L/main.log"
fi
# shellcheck disable=SC2086
has e2e && { bench e2e "${T_E2E:-300}" e2e_bench.py $E2E_ARGS || status=$?; }
for stage in attention decode prefill; do
  has "$stage" || continue
  args_var="${stage^^}_ARGS"; limit_var="T_${stage^^}"
  # shellcheck disable=SC2086
  bench "$stage" "${!limit_var:-420}" "${stage}_bench.py" ${!args_var} || status=$?
done
log "done (status $status); results in $OUT/session.tgz (results/ for the tree, logs/ beside it)"
exit "$status"
