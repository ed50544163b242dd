#!/usr/bin/env bash
# Session 10, call 4 (one H200): issue 20's GPU test files, five runs in a row, at main, with
# the replicated-residual file beside them.
set -u
export PYTHONUNBUFFERED=1
env STAGES="build tests" TEST_RUNS=5 T_TESTS=110 \
  TESTS="tests/test_ffi.py tests/test_loopback_gpu.py tests/test_cmdbuffer_gpu.py tests/test_ffi_gpu.py tests/test_fused_one_rank_gpu.py tests/test_residual_replicated_gpu.py" \
  OUT=$OUT bash benchmarks/gpu_session.sh 2>&1 | grep -E "gpu_session|passed|failed|error" | tail -30
