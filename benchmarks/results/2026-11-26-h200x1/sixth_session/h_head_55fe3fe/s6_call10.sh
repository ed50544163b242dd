#!/usr/bin/env bash
# Session 6, call 10 on one H200 (HEAD): test_cmdbuffer_gpu with the pair kernel's case (24
# rows of 8192 at N = 1: replays, bitwise, NaN after the communicator closes) and the
# one-rank test file.
set -u
final=$OUT; tmp=/tmp/s6c10; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
timeout 240 python3 -P -m pytest -q -rfEs -s -p no:cacheprovider tests/test_cmdbuffer_gpu.py tests/test_fused_one_rank_gpu.py > $tmp/tests.log 2>&1; echo "rc=$?"; grep "n=1\|passed\|failed" $tmp/tests.log | tail -8; pack
echo "=== end at $((SECONDS - t0)) s"
