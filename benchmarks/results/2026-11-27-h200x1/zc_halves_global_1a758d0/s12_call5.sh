#!/usr/bin/env bash
# Session 12, call 5 (one H200): the one-rank row as two halves whose CTAs swap their sums of
# squares through global memory (LocalRowsHalvesKernel, ffi/half_sums.cuh; working tree of
# 1a758d0 + this change, JAX_TOKENWEAVE_EXP_HALVES: 0 landed, 1 halves past 16 rows in place of
# the pair, 2 halves at every pair-size T in place of clusters too). Tests under 1 and 2, then
# profile_kernels at T = 1-64, two runs, and once with JAX_TOKENWEAVE_HALVES_WAIT_NS=0.
set -u
final=$OUT; tmp=/tmp/s12c5; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s12_call5.sh $tmp/; git diff > $tmp/change.diff 2>/dev/null; cp ffi/half_sums.cuh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for m in 1 2; do export JAX_TOKENWEAVE_EXP_HALVES=$m
  timeout 100 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_fused_one_rank_gpu.py tests/test_cmdbuffer_gpu.py > $tmp/tests_$m.log 2>&1; echo "tests $m rc=$? at $((SECONDS - t0)) s"; grep -E "FAILED|passed|failed" $tmp/tests_$m.log | tail -6; done
unset JAX_TOKENWEAVE_EXP_HALVES; pack
for run in 1 2; do
  for m in 0 1 2 w0; do
    unset JAX_TOKENWEAVE_HALVES_WAIT_NS
    if [ $m = w0 ]; then export JAX_TOKENWEAVE_EXP_HALVES=2 JAX_TOKENWEAVE_HALVES_WAIT_NS=0; else export JAX_TOKENWEAVE_EXP_HALVES=$m; fi
    [ $m = w0 ] && [ $run = 2 ] && continue
    timeout 45 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 1 16 24 32 48 64 --out $tmp/prof_${m}_$run > $tmp/prof_${m}_$run.log 2>&1; echo "prof $m $run rc=$? at $((SECONDS - t0)) s"
    grep "ffi" $tmp/prof_${m}_$run/profile_kernels.md | cut -d'|' -f2,4,5 | tr '\n' ';'; echo; done
  pack
done
unset JAX_TOKENWEAVE_EXP_HALVES JAX_TOKENWEAVE_HALVES_WAIT_NS; pack; echo "=== end at $((SECONDS - t0)) s"
