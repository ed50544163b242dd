#!/usr/bin/env bash
# Session 6, call 5 on one H200 (HEAD): the one-rank kernel's pair of CTAs a row (T > 32)
# against a block per row (JAX_TOKENWEAVE_ROW_CTAS=1), alternated; its GPU test file.
set -u
final=$OUT; tmp=/tmp/s6c5; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
echo "=== tests at $((SECONDS - t0)) s"
timeout 150 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_fused_one_rank_gpu.py > $tmp/tests_one_rank.log 2>&1; echo "rc=$?"; tail -3 $tmp/tests_one_rank.log; pack
for run in 1 2; do
  for v in pair block; do
    echo "=== $v run $run at $((SECONDS - t0)) s"
    if [ $v = block ]; then export JAX_TOKENWEAVE_ROW_CTAS=1; else unset JAX_TOKENWEAVE_ROW_CTAS; fi
    timeout 90 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 16 33 48 64 66 --out $tmp/prof_${v}_$run > $tmp/prof_${v}_$run.log 2>&1; echo "rc=$?"
    grep "ffi" $tmp/prof_${v}_$run/profile_kernels.md | cut -d'|' -f2-5
  done
done
unset JAX_TOKENWEAVE_ROW_CTAS
pack
echo "=== end at $((SECONDS - t0)) s"
