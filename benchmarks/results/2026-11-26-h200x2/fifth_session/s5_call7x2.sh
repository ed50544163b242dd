#!/usr/bin/env bash
# Session 5, call 7 on 2 GPUs (HEAD): the 2-GPU test files with programmatic launches on real
# peers; the fused kernel at decode sizes, TP 2, device time.
set -u
final=$OUT; tmp=/tmp/s5c7; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build + tests"
env STAGES="build tests" T_TESTS=200 TESTS="tests/test_ffi_gpu.py tests/test_multiprocess_gpu.py tests/test_cmdbuffer_gpu.py" OUT=$tmp/tests bash benchmarks/gpu_session.sh > $tmp/tests.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
grep -E "passed|failed|error|FAIL" $tmp/tests.log | tail -8; pack
echo "=== kernel at $((SECONDS - t0)) s"
timeout 150 python3 -P benchmarks/kernel_bench.py --out $tmp/kernel --tp 2 --hidden 8192 --tokens 1 16 64 256 --ctas 16 64 --algos auto --impls ffi xla --reps 10 --device-time > $tmp/kernel.log 2>&1; echo "rc=$?"; cat $tmp/kernel/kernel_bench.md 2>/dev/null | head -30 || tail -20 $tmp/kernel.log; pack
echo "=== end at $((SECONDS - t0)) s"
