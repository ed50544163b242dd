#!/usr/bin/env bash
# Session 7, call 3 on one H200: the one-rank and command-buffer GPU tests at HEAD (the single
# pair launch of 05ead82 had not run on a GPU); then, with exp_cut2.patch (env-gated), rows
# of 32-64 cut across a cluster of 2 CTAs (256 x 2 or 128 x 4 vectors per thread, no duplicate
# loads) against the pair kernel, runs alternated.
set -u
final=$OUT; tmp=/tmp/s7c3; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
git apply .scratch/exp_cut2.patch && cp .scratch/exp_cut2.patch $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
echo "=== tests at $((SECONDS - t0)) s"
timeout 200 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_fused_one_rank_gpu.py tests/test_cmdbuffer_gpu.py > $tmp/tests.log 2>&1; echo "rc=$?"; tail -3 $tmp/tests.log; pack
for run in 1 2; do
  for v in pair 256 128; do
    left=$((570 - SECONDS + t0)); [ $left -lt 30 ] && break 2
    echo "=== $v run $run at $((SECONDS - t0)) s"
    if [ $v = pair ]; then unset JAX_TOKENWEAVE_EXP_CUT2; else export JAX_TOKENWEAVE_EXP_CUT2=$v; fi
    timeout $((left < 90 ? left : 90)) python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 24 32 48 64 --out $tmp/prof_${v}_$run > $tmp/prof_${v}_$run.log 2>&1; echo "rc=$?"
    grep "ffi" $tmp/prof_${v}_$run/profile_kernels.md | cut -d'|' -f2-5
  done
done
unset JAX_TOKENWEAVE_EXP_CUT2
pack
echo "=== end at $((SECONDS - t0)) s"
