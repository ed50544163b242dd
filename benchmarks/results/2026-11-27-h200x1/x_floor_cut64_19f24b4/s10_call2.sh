#!/usr/bin/env bash
# Session 10, call 2 (one H200): issue 20's N = 1, T = 64 miss, with exp_s10.patch (env-gated):
#   - the call's memory traffic without its reduction (JAX_TOKENWEAVE_EXP_FLOOR=threads,
#     _FLOOR_W=1 with the weights): timing only, its norms are wrong;
#   - rows cut across clusters past 32 rows (JAX_TOKENWEAVE_EXP_CUT64=c CTAs a row,
#     _CUTU=vectors a thread), against the landed pair of CTAs a row;
#   - fresh loopback N = 2 figures at main (token-sharded and replicated residual).
set -u
final=$OUT; tmp=/tmp/s10c2; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s10_call2.sh .scratch/exp_s10.patch $tmp/
git apply .scratch/exp_s10.patch || { echo "patch failed"; exit 1; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
clr() { unset JAX_TOKENWEAVE_EXP_FLOOR JAX_TOKENWEAVE_EXP_FLOOR_W JAX_TOKENWEAVE_EXP_CUT64 JAX_TOKENWEAVE_EXP_CUTU; }
set_v() { clr; case $1 in
  pair) ;; f256) export JAX_TOKENWEAVE_EXP_FLOOR=256;; f512) export JAX_TOKENWEAVE_EXP_FLOOR=512;;
  f1024) export JAX_TOKENWEAVE_EXP_FLOOR=1024;; f512w) export JAX_TOKENWEAVE_EXP_FLOOR=512 JAX_TOKENWEAVE_EXP_FLOOR_W=1;;
  c4u1) export JAX_TOKENWEAVE_EXP_CUT64=4;; c2u2) export JAX_TOKENWEAVE_EXP_CUT64=2 JAX_TOKENWEAVE_EXP_CUTU=2;;
  c4u2) export JAX_TOKENWEAVE_EXP_CUT64=4 JAX_TOKENWEAVE_EXP_CUTU=2;; c8u1) export JAX_TOKENWEAVE_EXP_CUT64=8;;
  esac; }
for v in c4u1 c2u2 c4u2; do set_v $v
  timeout 60 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_fused_one_rank_gpu.py -k "(float64 and bfloat16) or chain" > $tmp/tests_$v.log 2>&1; echo "tests $v rc=$?"; tail -1 $tmp/tests_$v.log; done
pack; echo "tests end at $((SECONDS - t0)) s"
for run in 1 2; do
  vs="pair f256 f512 f1024 f512w c4u1 c2u2 c4u2 c8u1"; [ $run = 2 ] && vs="pair f512 c4u1 c2u2 c4u2 c8u1"
  for v in $vs; do set_v $v
    timeout 45 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 1 16 32 64 --out $tmp/prof_${v}_$run > $tmp/prof_${v}_$run.log 2>&1; echo "prof $v $run rc=$? at $((SECONDS - t0)) s"
    grep "ffi" $tmp/prof_${v}_$run/profile_kernels.md | cut -d'|' -f2-5 | tr '\n' ';'; echo; done
  clr
  for res in sharded replicated; do
    timeout 40 python3 -P benchmarks/loopback_bench.py --ranks 2 --tokens 1 16 --algos one_shot --ctas 64 --residual $res --out $tmp/lb_${res}_$run > $tmp/lb_${res}_$run.log 2>&1; echo "lb $res $run rc=$?"
    grep "^|" $tmp/lb_${res}_$run/*.md | grep -v -- "---" | grep -v "^| N" | cut -d'|' -f2-3,7 | tr '\n' ';'; echo; done
  pack
done
clr; pack; echo "=== end at $((SECONDS - t0)) s"
