#!/usr/bin/env bash
# Session 10, call 2 on one H200: 3f33dc4 (cut-row one-shot instances per thread count) and
# exp_lean.patch (JAX_TOKENWEAVE_EXP_LEAN=1: the poll verdict folded into the block sum, the
# final verdict barrier dropped). Tests under each, then loopback sweeps alternated x2.
set -u
final=$OUT; tmp=/tmp/s10c2; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s10_call2.sh .scratch/exp_lean.patch $tmp/
git apply .scratch/exp_lean.patch || { echo "patch failed"; exit 1; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for v in landed LEAN; do unset JAX_TOKENWEAVE_EXP_LEAN; [ $v = LEAN ] && export JAX_TOKENWEAVE_EXP_LEAN=1
  timeout 100 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_loopback_gpu.py tests/test_cmdbuffer_gpu.py > $tmp/tests_$v.log 2>&1; echo "tests $v rc=$?"; tail -1 $tmp/tests_$v.log; done
pack
for run in 1 2; do
  for v in landed LEAN; do unset JAX_TOKENWEAVE_EXP_LEAN; [ $v = LEAN ] && export JAX_TOKENWEAVE_EXP_LEAN=1
    for c in 16 32 64 128; do
      timeout 40 python3 -P benchmarks/loopback_bench.py --ranks $([ $c = 16 ] && echo 2 4 8 || echo 2) --tokens 1 16 --algos one_shot --ctas $c --out $tmp/lb_${v}_${c}_$run > $tmp/lb_${v}_${c}_$run.log 2>&1; echo "lb $v $c $run rc=$?"
      grep "^|" $tmp/lb_${v}_${c}_$run/*.md | grep -v -- "---" | grep -v "^| N" | cut -d'|' -f2-3,7 | tr '\n' ';'; echo; done; done
  pack
done
unset JAX_TOKENWEAVE_EXP_LEAN
timeout 60 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 1 16 64 256 --out $tmp/prof_tp1 > $tmp/prof_tp1.log 2>&1; echo "prof tp1 rc=$?"
grep "ffi" $tmp/prof_tp1/profile_kernels.md | cut -d'|' -f2-5 | tr '\n' ';'; echo
pack; echo "=== end at $((SECONDS - t0)) s"
