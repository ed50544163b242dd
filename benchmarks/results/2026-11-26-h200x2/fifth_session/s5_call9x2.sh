#!/usr/bin/env bash
# Session 5, call 9 on 2 GPUs (HEAD): command-buffer test on real peers; TP 2 decode sizes.
set -u
final=$OUT; tmp=/tmp/s5c9; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build + tests"
env STAGES="build tests" T_TESTS=150 TESTS="tests/test_cmdbuffer_gpu.py" OUT=$tmp/tests bash benchmarks/gpu_session.sh > $tmp/tests.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
grep -E "passed|failed|error|FAIL" $tmp/tests.log | tail -8; pack
echo "=== kernel at $((SECONDS - t0)) s"
timeout 100 python3 -P benchmarks/kernel_bench.py --out $tmp/kernel --tp 2 --hidden 8192 --tokens 1 16 64 --ctas 16 64 --algos auto --impls ffi xla --reps 10 --device-time > $tmp/kernel.log 2>&1; echo "rc=$?"; grep "^| 2" $tmp/kernel/kernel_bench.md | head -12; pack
echo "=== end at $((SECONDS - t0)) s"
