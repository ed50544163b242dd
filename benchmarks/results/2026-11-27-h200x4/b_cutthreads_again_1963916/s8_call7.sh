#!/usr/bin/env bash
# Session 8, call 7 on 4 x H200 (nvidia-h200-x4): the one-shot cut rows on CutThreads CTAs
# (1963916): kernel_bench again after call 6 (new, old), on the same warm machine where it
# still is, then the old files again (old2), for the spread between runs.
set -u
final=$OUT; tmp=/tmp/s8c7; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s8_call7.sh $tmp/
nvidia-smi topo -m > $tmp/topo.txt 2>&1
build() { env STAGES=build OUT=$tmp/build_$1 bash benchmarks/gpu_session.sh > $tmp/build_$1.log 2>&1; echo "build $1 rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build_$1; }
bench() {
  left=$((560 - SECONDS + t0)); [ $left -lt 40 ] && { echo "skip $1"; return; }
  timeout $((left < 120 ? left : 120)) python3 -P benchmarks/kernel_bench.py --out $tmp/kb_$1 --tp 2 4 --hidden 8192 --tokens 1 16 --ctas 32 64 128 --algos one_shot --impls ffi --reps 10 --device-time --time-budget 90 > $tmp/kb_$1.log 2>&1; echo "bench $1 rc=$? at $((SECONDS - t0)) s"
  grep "^| [24] " $tmp/kb_$1/*.md | cut -d'|' -f2-9 | tr -s ' ' | tr '\n' ';'; echo; pack
}
build new2; bench new2
cp .scratch/ffi_old/* ffi/ && build old2 && bench old2
cp .scratch/ffi_new/* ffi/
pack; echo "=== end at $((SECONDS - t0)) s"
