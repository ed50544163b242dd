#!/usr/bin/env bash
# Session 10, call 5 on one H200: 2f770f2, where loopback N = 2 time grows with T. One-shot,
# 64 CTAs per rank, T = 1-16, row CTAs by policy and held at 4 (JAX_TOKENWEAVE_ROW_CTAS=4),
# with each call's kernel time profiled (--profile 10).
set -u
final=$OUT; tmp=/tmp/s10c5; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s10_call5.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for run in 1 2; do for rc in policy 4; do
  unset JAX_TOKENWEAVE_ROW_CTAS; [ $rc = 4 ] && export JAX_TOKENWEAVE_ROW_CTAS=4
  timeout 60 python3 -P benchmarks/loopback_bench.py --ranks 2 --tokens 1 2 4 8 12 16 --algos one_shot --ctas 64 --profile 10 --out $tmp/lb_${rc}_$run > $tmp/lb_${rc}_$run.log 2>&1; echo "lb $rc $run rc=$?"
  grep "^|" $tmp/lb_${rc}_$run/*.md | grep -v -- "---" | cut -c1-160
  pack; done; done
echo "=== end at $((SECONDS - t0)) s"
