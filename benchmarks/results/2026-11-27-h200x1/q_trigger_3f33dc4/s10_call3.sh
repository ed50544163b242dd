#!/usr/bin/env bash
# Session 10, call 3 on one H200: 3f33dc4 + exp_trigger.patch. Where the decode one-shot kernel
# lets the next call launch (PDL): JAX_TOKENWEAVE_EXP_TRIGGER=1 after the row's norm sum, =2 at
# the end, against the landed (after the poll verdict). JAX_TOKENWEAVE_EXP_PAIR_LATE=1: the
# one-rank pair kernel triggers at its end, against at its start.
set -u
final=$OUT; tmp=/tmp/s10c3; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s10_call3.sh .scratch/exp_trigger.patch $tmp/
git apply .scratch/exp_trigger.patch || { echo "patch failed"; exit 1; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
clr() { unset JAX_TOKENWEAVE_EXP_TRIGGER JAX_TOKENWEAVE_EXP_PAIR_LATE; }
for v in 1 2; do clr; export JAX_TOKENWEAVE_EXP_TRIGGER=$v
  timeout 60 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_loopback_gpu.py > $tmp/tests_trigger$v.log 2>&1; echo "tests trigger$v rc=$?"; tail -1 $tmp/tests_trigger$v.log; done
pack
for run in 1 2; do
  for v in landed 1 2; do clr; [ $v != landed ] && export JAX_TOKENWEAVE_EXP_TRIGGER=$v
    for c in 16 64 128; do
      timeout 40 python3 -P benchmarks/loopback_bench.py --ranks $([ $c = 16 ] && echo 2 4 8 || echo 2) --tokens 1 16 --algos one_shot --ctas $c --out $tmp/lb_${v}_${c}_$run > $tmp/lb_${v}_${c}_$run.log 2>&1; echo "lb $v $c $run rc=$?"
      grep "^|" $tmp/lb_${v}_${c}_$run/*.md | grep -v -- "---" | grep -v "^| N" | cut -d'|' -f2-3,7 | tr '\n' ';'; echo; done; done
  for v in pair late; do clr; [ $v = late ] && export JAX_TOKENWEAVE_EXP_PAIR_LATE=1
    timeout 60 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 32 64 --out $tmp/prof_${v}_$run > $tmp/prof_${v}_$run.log 2>&1; echo "prof $v $run rc=$?"
    grep "ffi" $tmp/prof_${v}_$run/profile_kernels.md | cut -d'|' -f2-5 | tr '\n' ';'; echo; done
  pack
done
clr; pack; echo "=== end at $((SECONDS - t0)) s"
