#!/usr/bin/env bash
# Session 10, call 4 on one H200: 46bdcf5 as landed (cut-row one-shot instances per thread
# count): issue 20's five GPU test files 5 runs in a row, then loopback at 16 and 64 CTAs.
set -u
final=$OUT; tmp=/tmp/s10c4; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s10_call4.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
echo "=== tests x5 at $((SECONDS - t0)) s"
env STAGES=tests TEST_RUNS=5 T_TESTS=110 TESTS="tests/test_ffi.py tests/test_loopback_gpu.py tests/test_cmdbuffer_gpu.py tests/test_ffi_gpu.py tests/test_fused_one_rank_gpu.py" OUT=$tmp/tests bash benchmarks/gpu_session.sh > $tmp/tests.log 2>&1; echo "rc=$?"
grep -h -E "passed|failed" $tmp/tests/tests*.log 2>/dev/null | tail -6; grep -E "passed|failed" $tmp/tests.log | tail -6
pack
for c in 16 64; do
  [ $((SECONDS - t0)) -gt 540 ] && break
  timeout 30 python3 -P benchmarks/loopback_bench.py --ranks $([ $c = 16 ] && echo 2 4 8 || echo 2) --tokens 1 16 --algos one_shot --ctas $c --out $tmp/lb_$c > $tmp/lb_$c.log 2>&1; echo "lb $c rc=$?"
  grep "^|" $tmp/lb_$c/*.md | grep -v -- "---" | grep -v "^| N" | cut -d'|' -f2-3,7 | tr '\n' ';'; echo
done
pack; echo "=== end at $((SECONDS - t0)) s"
