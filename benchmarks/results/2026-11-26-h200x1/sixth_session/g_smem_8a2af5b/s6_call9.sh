#!/usr/bin/env bash
# Session 6, call 9 on one H200 (8a2af5b + exp_pair_smem.patch): the pair kernel with 120 KB of
# (unused) dynamic shared memory per CTA, so no SM holds two of its CTAs, against without.
set -u
final=$OUT; tmp=/tmp/s6c9; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
git apply .scratch/exp_pair_smem.patch && echo patched
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
for run in 1 2; do
  for v in 0 120000; do
    echo "=== smem $v run $run at $((SECONDS - t0)) s"
    JAX_TOKENWEAVE_PAIR_SMEM=$v timeout 90 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 24 48 64 66 --out $tmp/prof_${v}_$run > $tmp/prof_${v}_$run.log 2>&1; echo "rc=$?"
    grep "ffi" $tmp/prof_${v}_$run/profile_kernels.md | cut -d'|' -f2-5
  done
done
echo "=== block per row at $((SECONDS - t0)) s"
JAX_TOKENWEAVE_ROW_CTAS=1 timeout 90 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 24 48 64 66 --out $tmp/prof_block > $tmp/prof_block.log 2>&1; echo "rc=$?"; grep "ffi" $tmp/prof_block/profile_kernels.md | cut -d'|' -f2-5
pack
echo "=== end at $((SECONDS - t0)) s"
