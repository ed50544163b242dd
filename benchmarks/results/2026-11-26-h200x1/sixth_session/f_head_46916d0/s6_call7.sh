#!/usr/bin/env bash
# Session 6, call 7 on one H200 (HEAD): issue 20's GPU test files 5 runs in a row with the
# pair kernel; the N = 1 chain at every size; e2e decode at TP 1 (weave-ffi vs baseline).
set -u
final=$OUT; tmp=/tmp/s6c7; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
env STAGES="build tests" TEST_RUNS=5 T_TESTS=100 TESTS="tests/test_ffi.py tests/test_loopback_gpu.py tests/test_cmdbuffer_gpu.py tests/test_ffi_gpu.py tests/test_fused_one_rank_gpu.py" OUT=$tmp/tests bash benchmarks/gpu_session.sh > $tmp/tests.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
tar xzf $tmp/tests/session.tgz -C $tmp/tests 2>/dev/null; grep -h "passed\|failed" $tmp/tests/*/tests_*.log $tmp/tests/tests_*.log 2>/dev/null | tail -6; pack
echo "=== profile at $((SECONDS - t0)) s"
timeout 90 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 1 16 24 32 48 64 256 --out $tmp/prof > $tmp/prof.log 2>&1; echo "rc=$?"; grep "|" $tmp/prof/profile_kernels.md | cut -d'|' -f2-5; pack
echo "=== e2e at $((SECONDS - t0)) s"
timeout $((590 - SECONDS + t0)) python3 -P benchmarks/e2e_bench.py --out $tmp/e2e --models llama3-8b --tp 1 --layers 32 --no-prefill --decode-tokens 1 64 256 --decode-modes baseline weave-ffi --iters 5 > $tmp/e2e.log 2>&1; echo "rc=$?"; grep "^|" $tmp/e2e/e2e.md 2>/dev/null | head -12; pack
echo "=== end at $((SECONDS - t0)) s"
