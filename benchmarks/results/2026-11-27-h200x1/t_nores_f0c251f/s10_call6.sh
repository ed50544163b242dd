#!/usr/bin/env bash
# Session 10, call 6 on one H200: f0c251f + exp_nores.patch (timing only: the cut-row one-shot
# kernel without the residual exchange, JAX_TOKENWEAVE_EXP_NO_RES=1; its rows are wrong, the
# rel err column shows it). Does the second row's residual exchange make T = 2 cost 0.45 us
# more than T = 1? Loopback N = 2, 64 CTAs, T = 1 2 4 16, alternated x2.
set -u
final=$OUT; tmp=/tmp/s10c6; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s10_call6.sh .scratch/exp_nores.patch $tmp/
git apply .scratch/exp_nores.patch || { echo "patch failed"; exit 1; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for run in 1 2; do for v in landed nores; do
  unset JAX_TOKENWEAVE_EXP_NO_RES; [ $v = nores ] && export JAX_TOKENWEAVE_EXP_NO_RES=1
  timeout 40 python3 -P benchmarks/loopback_bench.py --ranks 2 --tokens 1 2 4 16 --algos one_shot --ctas 64 --out $tmp/lb_${v}_$run > $tmp/lb_${v}_$run.log 2>&1; echo "lb $v $run rc=$?"
  grep "^|" $tmp/lb_${v}_$run/*.md | grep -v -- "---" | grep -v "^| N" | cut -d'|' -f2-3,7,9 | tr '\n' ';'; echo
  pack; done; done
echo "=== end at $((SECONDS - t0)) s"
