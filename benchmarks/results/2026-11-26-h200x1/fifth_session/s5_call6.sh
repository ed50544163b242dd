#!/usr/bin/env bash
# Session 5, call 6 (HEAD): issue 20's GPU test files 5 runs in a row; loopback; N = 1 profile.
set -u
final=$OUT; tmp=/tmp/s5c6; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build + tests x5"
env STAGES="build tests" TEST_RUNS=5 T_TESTS=100 TESTS="tests/test_ffi.py tests/test_loopback_gpu.py tests/test_cmdbuffer_gpu.py tests/test_ffi_gpu.py tests/test_fused_one_rank_gpu.py" OUT=$tmp/tests bash benchmarks/gpu_session.sh > $tmp/tests.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
grep -E "passed|failed|error" $tmp/tests.log | tail -8; pack
echo "=== loopback at $((SECONDS - t0)) s"
timeout 45 python3 -P benchmarks/loopback_bench.py --out $tmp/lb16 --ranks 2 8 --tokens 1 16 --algos one_shot --ctas 16 > $tmp/lb16.log 2>&1; echo "rc=$?"; grep "^|" $tmp/lb16/*.md | head -8
for c in 64 128; do timeout 30 python3 -P benchmarks/loopback_bench.py --out $tmp/lb$c --ranks 2 --tokens 1 16 --algos one_shot --ctas $c > $tmp/lb$c.log 2>&1; echo "rc=$?"; grep "^|" $tmp/lb$c/*.md | tail -2; done; pack
echo "=== profile N=1 at $((SECONDS - t0)) s"
timeout 70 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 1 16 32 64 256 --out $tmp/prof > $tmp/prof.log 2>&1; echo "rc=$?"; grep "^|" $tmp/prof/*.md | cut -c1-70; pack
echo "=== end at $((SECONDS - t0)) s"
