#!/usr/bin/env bash
# Session 6, call 6 on one H200 (5b1ff4a + exp_pair_min_rows.patch): the pair of CTAs a row
# against clusters at 1-32 rows (JAX_TOKENWEAVE_PAIR_MIN_ROWS=0 takes the pair wherever it
# fits), alternated.
set -u
final=$OUT; tmp=/tmp/s6c6; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
git apply .scratch/exp_pair_min_rows.patch && echo patched
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
for run in 1 2; do
  for v in cluster pair; do
    echo "=== $v run $run at $((SECONDS - t0)) s"
    if [ $v = pair ]; then export JAX_TOKENWEAVE_PAIR_MIN_ROWS=0; else unset JAX_TOKENWEAVE_PAIR_MIN_ROWS; fi
    timeout 90 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 1 4 8 16 24 32 --out $tmp/prof_${v}_$run > $tmp/prof_${v}_$run.log 2>&1; echo "rc=$?"
    grep "ffi" $tmp/prof_${v}_$run/profile_kernels.md | cut -d'|' -f2-5
  done
done
pack
echo "=== end at $((SECONDS - t0)) s"
