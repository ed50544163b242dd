#!/usr/bin/env bash
# Session 12, call 1 (one H200): issue 20's N = 1, T = 64 miss, with exp_s12.patch (env-gated
# JAX_TOKENWEAVE_EXP_PAIR): the pair's row read by bulk copies (TMA) into shared memory, whole
# (1), in two chunks (2), or half per CTA multicast across a cluster of two (3); diagnostics of
# the landed pair: no block sum (4, wrong norms), each CTA loads only its half (5, wrong norms).
set -u
final=$OUT; tmp=/tmp/s12c1; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s12_call1.sh .scratch/exp_s12.patch $tmp/
git apply .scratch/exp_s12.patch || { echo "patch failed"; exit 1; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for m in 1 2 3; do export JAX_TOKENWEAVE_EXP_PAIR=$m
  timeout 60 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_fused_one_rank_gpu.py -k "bfloat16 or chain" > $tmp/tests_$m.log 2>&1; echo "tests $m rc=$?"; tail -1 $tmp/tests_$m.log; done
unset JAX_TOKENWEAVE_EXP_PAIR; pack; echo "tests end at $((SECONDS - t0)) s"
for run in 1 2 3; do
  for m in 0 1 2 3 4 5; do
    if [ $m = 0 ]; then unset JAX_TOKENWEAVE_EXP_PAIR; else export JAX_TOKENWEAVE_EXP_PAIR=$m; fi
    timeout 45 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 16 32 48 64 --out $tmp/prof_${m}_$run > $tmp/prof_${m}_$run.log 2>&1; echo "prof $m $run rc=$? at $((SECONDS - t0)) s"
    grep "ffi" $tmp/prof_${m}_$run/profile_kernels.md | cut -d'|' -f2-5 | tr '\n' ';'; echo; done
  pack
done
unset JAX_TOKENWEAVE_EXP_PAIR; pack; echo "=== end at $((SECONDS - t0)) s"
