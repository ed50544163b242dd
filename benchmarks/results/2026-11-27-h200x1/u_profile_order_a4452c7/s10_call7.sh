#!/usr/bin/env bash
# Session 10, call 7 on one H200: does a --profile session slow the loopback timings after it?
# loopback_bench as of f0c251f (each point profiled after its own timings) against the fixed
# one (profile after every timing), N = 2, T = 1 2 4 16, 64 CTAs, --profile 10, alternated x2.
set -u
final=$OUT; tmp=/tmp/s10c7; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s10_call7.sh .scratch/loopback_bench_old.py $tmp/
cp .scratch/loopback_bench_old.py benchmarks/loopback_bench_old.py
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for run in 1 2; do for v in old new; do
  s=benchmarks/loopback_bench.py; [ $v = old ] && s=benchmarks/loopback_bench_old.py
  timeout 50 python3 -P $s --ranks 2 --tokens 1 2 4 16 --algos one_shot --ctas 64 --profile 10 --out $tmp/lb_${v}_$run > $tmp/lb_${v}_$run.log 2>&1; echo "lb $v $run rc=$?"
  grep "^|" $tmp/lb_${v}_$run/*.md | grep -v -- "---" | grep -v "^| N" | cut -d'|' -f2-3,7,8 | tr '\n' ';'; echo
  pack; done; done
rm -f benchmarks/loopback_bench_old.py; echo "=== end at $((SECONDS - t0)) s"
