#!/usr/bin/env bash
# Session 8, call 4 on one H200: issue 20's loopback T = 16 with exp_cutblock.patch (env-gated,
# JAX_TOKENWEAVE_EXP_CUTBLOCK=1): a one-shot row cut across c CTAs runs on CTAs of H / 8 / c
# threads (128 or 256) instead of 512 with the rest idle. Loopback GPU tests with it on, then
# loopback_bench at 16 and 64 CTAs, off and on, alternated.
set -u
final=$OUT; tmp=/tmp/s8c4; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s8_call4.sh .scratch/exp_cutblock.patch $tmp/
git apply .scratch/exp_cutblock.patch || { echo "patch failed"; exit 1; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
echo "=== tests (on) at $((SECONDS - t0)) s"
JAX_TOKENWEAVE_EXP_CUTBLOCK=1 timeout 200 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_loopback_gpu.py > $tmp/tests_on.log 2>&1; echo "rc=$?"; tail -2 $tmp/tests_on.log; pack
for run in 1 2; do
  for v in off on; do
    for c in 16 64; do
      left=$((570 - SECONDS + t0)); [ $left -lt 40 ] && break 3
      echo "=== $v ctas $c run $run at $((SECONDS - t0)) s"
      if [ $v = on ]; then export JAX_TOKENWEAVE_EXP_CUTBLOCK=1; else unset JAX_TOKENWEAVE_EXP_CUTBLOCK; fi
      timeout $((left < 100 ? left : 100)) python3 -P benchmarks/loopback_bench.py --ranks $([ $c = 16 ] && echo 2 4 8 || echo 2) --tokens 1 16 --algos one_shot --ctas $c --out $tmp/lb_${v}_${c}_$run > $tmp/lb_${v}_${c}_$run.log 2>&1; echo "rc=$?"
      grep "^|" $tmp/lb_${v}_${c}_$run/*.md | grep -v -- "---" | cut -c1-160
    done
  done
done
unset JAX_TOKENWEAVE_EXP_CUTBLOCK; pack
echo "=== end at $((SECONDS - t0)) s"
