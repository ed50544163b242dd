#!/usr/bin/env bash
# Session 8, call 8 on one H200: 1963916 as landed (CutThreads from blockDim, one instance):
# loopback_bench at 16 and 64 CTAs per rank, then issue 20's GPU test files 5 runs in a row.
set -u
final=$OUT; tmp=/tmp/s8c8; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s8_call8.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for c in 16 64 128; do
  timeout 60 python3 -P benchmarks/loopback_bench.py --ranks $([ $c = 16 ] && echo 2 4 8 || echo 2) --tokens 1 16 --algos one_shot --ctas $c --out $tmp/lb_$c > $tmp/lb_$c.log 2>&1; echo "lb $c rc=$?"
  grep "^|" $tmp/lb_$c/*.md | grep -v -- "---" | grep -v "^| N" | cut -c1-100
done
pack
echo "=== tests x5 at $((SECONDS - t0)) s"
env STAGES=tests TEST_RUNS=5 T_TESTS=110 TESTS="tests/test_ffi.py tests/test_loopback_gpu.py tests/test_cmdbuffer_gpu.py tests/test_ffi_gpu.py tests/test_fused_one_rank_gpu.py" OUT=$tmp/tests bash benchmarks/gpu_session.sh > $tmp/tests.log 2>&1; echo "rc=$?"
grep -h -E "passed|failed" $tmp/tests/tests*.log 2>/dev/null | tail -6; grep -E "passed|failed" $tmp/tests.log | tail -6
pack; echo "=== end at $((SECONDS - t0)) s"
