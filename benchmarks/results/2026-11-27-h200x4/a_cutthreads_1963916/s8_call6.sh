#!/usr/bin/env bash
# Session 8, call 6 on 4 x H200 (nvidia-h200-x4): the one-shot cut rows on CutThreads CTAs
# (1963916) against the same tree with its four changed ffi/ files at bfb6bb2 (.scratch/ffi_old) (512-thread CTAs), on real peers:
# kernel_bench at TP 2 and 4, T = 1 / 16, one-shot, 32-128 CTAs, profiled device time, new
# then old; tests/test_ffi_gpu.py (a 2-GPU mesh) once with the new kernel in between.
set -u
final=$OUT; tmp=/tmp/s8c6; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s8_call6.sh $tmp/
nvidia-smi topo -m > $tmp/topo.txt 2>&1
build() { env STAGES=build OUT=$tmp/build_$1 bash benchmarks/gpu_session.sh > $tmp/build_$1.log 2>&1; echo "build $1 rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build_$1; }
bench() {
  left=$((560 - SECONDS + t0)); [ $left -lt 40 ] && { echo "skip $1"; return; }
  timeout $((left < 120 ? left : 120)) python3 -P benchmarks/kernel_bench.py --out $tmp/kb_$1 --tp 2 4 --hidden 8192 --tokens 1 16 --ctas 32 64 128 --algos one_shot --impls ffi --reps 10 --device-time --time-budget 90 > $tmp/kb_$1.log 2>&1; echo "bench $1 rc=$? at $((SECONDS - t0)) s"
  grep "^| [24] " $tmp/kb_$1/*.md | cut -d'|' -f2-9 | tr -s ' ' | tr '\n' ';'; echo; pack
}
build new; bench new1
echo "=== tests at $((SECONDS - t0)) s"
timeout 150 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_ffi_gpu.py > $tmp/tests_ffi_gpu.log 2>&1; echo "rc=$?"; tail -3 $tmp/tests_ffi_gpu.log; pack
cp .scratch/ffi_old/* ffi/ && build old && bench old1
cp .scratch/ffi_new/* ffi/
pack; echo "=== end at $((SECONDS - t0)) s"
