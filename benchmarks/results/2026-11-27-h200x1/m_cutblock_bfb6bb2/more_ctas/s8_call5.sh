#!/usr/bin/env bash
# Session 8, call 5 on one H200: exp_cutblock.patch (on) at 32 and 128 CTAs per rank, against
# off, loopback N = 2 (and 4 at 32 CTAs), T = 1 / 16.
set -u
final=$OUT; tmp=/tmp/s8c5; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s8_call5.sh .scratch/exp_cutblock.patch $tmp/
git diff --quiet ffi/oneshot_rows.cu && { git apply .scratch/exp_cutblock.patch || { echo "patch failed"; exit 1; }; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for run in 1 2; do
  for v in off on; do
    for c in 32 128; do
      left=$((570 - SECONDS + t0)); [ $left -lt 40 ] && break 3
      echo "=== $v ctas $c run $run at $((SECONDS - t0)) s"
      if [ $v = on ]; then export JAX_TOKENWEAVE_EXP_CUTBLOCK=1; else unset JAX_TOKENWEAVE_EXP_CUTBLOCK; fi
      timeout $((left < 100 ? left : 100)) python3 -P benchmarks/loopback_bench.py --ranks $([ $c = 32 ] && echo 2 4 || echo 2) --tokens 1 16 --algos one_shot --ctas $c --out $tmp/lb_${v}_${c}_$run > $tmp/lb_${v}_${c}_$run.log 2>&1; echo "rc=$?"
      grep "^|" $tmp/lb_${v}_${c}_$run/*.md | grep -v -- "---" | grep -v "^| N" | cut -c1-100
    done
  done
done
unset JAX_TOKENWEAVE_EXP_CUTBLOCK; pack
echo "=== end at $((SECONDS - t0)) s"
