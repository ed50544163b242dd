#!/usr/bin/env bash
# Session 8, call 2 on one H200 (call 1's machine): issue 20's T = 64 at N = 1 with
# exp_t64.patch (env-gated): rows of 17-64 as a cluster of 2 CTAs of 512 threads, one vector
# each (JAX_TOKENWEAVE_EXP_CUT2=512), or a pair of 1024-thread CTAs that each load the row and
# store half (JAX_TOKENWEAVE_EXP_PAIR1024=1), against the pair kernel, runs alternated; the
# one-rank GPU tests under each variant first.
set -u
final=$OUT; tmp=/tmp/s8c2; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s8_call2.sh .scratch/exp_t64.patch $tmp/
git apply .scratch/exp_t64.patch || { echo "patch failed"; exit 1; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
setv() { unset JAX_TOKENWEAVE_EXP_CUT2 JAX_TOKENWEAVE_EXP_PAIR1024; case $1 in cut512) export JAX_TOKENWEAVE_EXP_CUT2=512;; pair1024) export JAX_TOKENWEAVE_EXP_PAIR1024=1;; esac; }
for v in cut512 pair1024; do
  setv $v; echo "=== tests $v at $((SECONDS - t0)) s"
  timeout 120 python3 -P -m pytest -q -x -rfEs -p no:cacheprovider tests/test_fused_one_rank_gpu.py -k "float64 or chain or xla" > $tmp/tests_$v.log 2>&1; echo "rc=$?"; tail -2 $tmp/tests_$v.log
done
for run in 1 2; do
  for v in pair cut512 pair1024; do
    left=$((570 - SECONDS + t0)); [ $left -lt 30 ] && break 2
    setv $v; echo "=== $v run $run at $((SECONDS - t0)) s"
    timeout $((left < 90 ? left : 90)) python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 24 32 48 64 --out $tmp/prof_${v}_$run > $tmp/prof_${v}_$run.log 2>&1; echo "rc=$?"
    grep "ffi" $tmp/prof_${v}_$run/profile_kernels.md | cut -d'|' -f2-5
  done
done
setv none; pack
echo "=== end at $((SECONDS - t0)) s"
