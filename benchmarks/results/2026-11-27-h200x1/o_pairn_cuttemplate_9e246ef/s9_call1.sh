#!/usr/bin/env bash
# Next session, call 1 on one H200 (prepared 2026-11-27, not yet run): issue 20's two misses
# with exp_next.patch (env-gated, against main at 6f9b66c or later):
#   - N = 1, 17-66 rows: a pair of 256-thread CTAs x 4 vectors (JAX_TOKENWEAVE_EXP_PAIR=256)
#     or 128 x 8 (=128), against the pair of 512 x 2;
#   - loopback one-shot cut rows: template instances of 128 / 256 threads
#     (JAX_TOKENWEAVE_EXP_CUT_TEMPLATE=1) and the previous buffer's clear moved after the rows
#     (JAX_TOKENWEAVE_EXP_CLEAR_LATE=1), against the landed single instance.
# Tests first under each variant; then runs alternated.
set -u
final=$OUT; tmp=/tmp/s9c1; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s9_call1.sh .scratch/exp_next.patch $tmp/
git apply .scratch/exp_next.patch || { echo "patch failed"; exit 1; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
clr() { unset JAX_TOKENWEAVE_EXP_PAIR JAX_TOKENWEAVE_EXP_CUT_TEMPLATE JAX_TOKENWEAVE_EXP_CLEAR_LATE; }
for v in 256 128; do clr; export JAX_TOKENWEAVE_EXP_PAIR=$v
  timeout 60 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_fused_one_rank_gpu.py -k "float64 or chain or xla" > $tmp/tests_pair$v.log 2>&1; echo "tests pair$v rc=$?"; tail -1 $tmp/tests_pair$v.log; done
for v in CUT_TEMPLATE CLEAR_LATE; do clr; export JAX_TOKENWEAVE_EXP_$v=1
  timeout 90 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_loopback_gpu.py > $tmp/tests_$v.log 2>&1; echo "tests $v rc=$?"; tail -1 $tmp/tests_$v.log; done
pack
for run in 1 2; do
  for v in pair 256 128; do clr; [ $v != pair ] && export JAX_TOKENWEAVE_EXP_PAIR=$v
    timeout 60 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 24 32 48 64 --out $tmp/prof_${v}_$run > $tmp/prof_${v}_$run.log 2>&1; echo "prof $v $run rc=$?"
    grep "ffi" $tmp/prof_${v}_$run/profile_kernels.md | cut -d'|' -f2-5 | tr '\n' ';'; echo; done
  for v in landed CUT_TEMPLATE CLEAR_LATE; do clr; [ $v != landed ] && export JAX_TOKENWEAVE_EXP_$v=1
    for c in 16 64; do
      timeout 40 python3 -P benchmarks/loopback_bench.py --ranks $([ $c = 16 ] && echo 2 4 8 || echo 2) --tokens 1 16 --algos one_shot --ctas $c --out $tmp/lb_${v}_${c}_$run > $tmp/lb_${v}_${c}_$run.log 2>&1; echo "lb $v $c $run rc=$?"
      grep "^|" $tmp/lb_${v}_${c}_$run/*.md | grep -v -- "---" | grep -v "^| N" | cut -d'|' -f2-3,7 | tr '\n' ';'; echo; done; done
  pack
done
clr; pack; echo "=== end at $((SECONDS - t0)) s"
