#!/usr/bin/env bash
# Session 12, call 2 (one H200): are cluster launches slow at T = 32-64 because a cluster's CTAs
# share an SM? exp_s12b.patch (env-gated): JAX_TOKENWEAVE_EXP_SPREAD=1 asks clusters to spread
# over SMs (cudaClusterSchedulingPolicySpread), _EXP_SMEM=bytes pads cluster launches' dynamic
# shared memory so an SM holds one such CTA; _EXP_PAIR=6 cuts rows across clusters of two
# (512 threads, one vector each) at any T, 3 the cluster-multicast bulk copy. Then loopback
# N = 2 (clusters of the decode one-shot kernel) with and without spreading.
set -u
final=$OUT; tmp=/tmp/s12c2; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s12_call2.sh .scratch/exp_s12b.patch $tmp/
git apply .scratch/exp_s12b.patch || { echo "patch failed"; exit 1; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
clr() { unset JAX_TOKENWEAVE_EXP_PAIR JAX_TOKENWEAVE_EXP_SPREAD JAX_TOKENWEAVE_EXP_SMEM; }
set_v() { clr; case $1 in
  land) ;; lands) export JAX_TOKENWEAVE_EXP_SPREAD=1;;
  c2) export JAX_TOKENWEAVE_EXP_PAIR=6;; c2s) export JAX_TOKENWEAVE_EXP_PAIR=6 JAX_TOKENWEAVE_EXP_SPREAD=1;;
  c2m) export JAX_TOKENWEAVE_EXP_PAIR=6 JAX_TOKENWEAVE_EXP_SMEM=120000;;
  mcs) export JAX_TOKENWEAVE_EXP_PAIR=3 JAX_TOKENWEAVE_EXP_SPREAD=1;;
  mcm) export JAX_TOKENWEAVE_EXP_PAIR=3 JAX_TOKENWEAVE_EXP_SMEM=120000;;
  esac; }
for v in c2s mcm; do set_v $v
  timeout 60 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_fused_one_rank_gpu.py -k "bfloat16 or chain" > $tmp/tests_$v.log 2>&1; echo "tests $v rc=$?"; tail -1 $tmp/tests_$v.log; done
clr; pack
for run in 1 2; do
  for v in land lands c2 c2s c2m mcs mcm; do set_v $v
    timeout 45 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 1 16 32 48 64 --out $tmp/prof_${v}_$run > $tmp/prof_${v}_$run.log 2>&1; echo "prof $v $run rc=$? at $((SECONDS - t0)) s"
    grep "ffi" $tmp/prof_${v}_$run/profile_kernels.md | cut -d'|' -f2,4 | tr '\n' ';'; echo; done
  for sp in 0 1; do clr; [ $sp = 1 ] && export JAX_TOKENWEAVE_EXP_SPREAD=1
    for res in sharded replicated; do
      timeout 40 python3 -P benchmarks/loopback_bench.py --ranks 2 --tokens 1 16 --algos one_shot --ctas 64 --residual $res --out $tmp/lb_${res}_s${sp}_$run > $tmp/lb_${res}_s${sp}_$run.log 2>&1; echo "lb $res spread=$sp $run rc=$?"
      grep "^|" $tmp/lb_${res}_s${sp}_$run/*.md | grep -v -- "---" | grep -v "^| N" | cut -d'|' -f2-3,7 | tr '\n' ';'; echo; done; done
  pack
done
clr; pack; echo "=== end at $((SECONDS - t0)) s"
