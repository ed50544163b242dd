#!/usr/bin/env bash
# Session 5, call 2 (warm, patched tree from call 1 re-sent clean): L2 prefetch-size hints.
set -u
final=$OUT; tmp=/tmp/s5c2; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
ATT="--no-prefill --impls cuda --iters 5 --profile 3 --no-plot --batch 16 256 --context 1024 8192"
att() { echo "=== attention $1 at $((SECONDS - t0)) s"; timeout 70 python3 -P benchmarks/attention_bench.py --out $tmp/att_$1 $ATT > $tmp/att_$1.log 2>&1
  echo "rc=$?"; grep "^|" $tmp/att_$1/attention.md | head -8; pack; }
rebuild() { echo "=== rebuild $1 at $((SECONDS - t0)) s"; python3 -m pip install --no-build-isolation --no-deps -e . > $tmp/build_$1.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; }
git apply .scratch/exp_headmajor.patch 2>/dev/null || patch -p1 < .scratch/exp_headmajor.patch
for hint in 256B 128B; do
  sed -i "s/cp.async.cg.shared.global\(\.L2::[0-9]*B\)\? \[/cp.async.cg.shared.global.L2::$hint [/" ffi/attention_mma.cuh
  grep -n "cp.async.cg" ffi/attention_mma.cuh
  rebuild $hint
  att $hint
  [[ $hint == 256B ]] && EXP_HEADMAJOR=1 att ${hint}hm
done
echo "=== end at $((SECONDS - t0)) s"
