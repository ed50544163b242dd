#!/usr/bin/env bash
# Session 6, call 11 on one H200 (HEAD): decode batch 256, XLA's default GEMM autotuning
# against --xla_gpu_exhaustive_tiling_search=true (more Triton configs), one run each.
set -u
final=$OUT; tmp=/tmp/s6c11; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
echo "=== default at $((SECONDS - t0)) s"
timeout 120 python3 -P benchmarks/decode_bench.py --out $tmp/dec_default --batch 256 --context 1024 --steps 12 --profile-steps 0 --no-plot > $tmp/dec_default.log 2>&1; echo "rc=$?"; grep "^|" $tmp/dec_default/decode.md | tail -1; pack
echo "=== exhaustive at $((SECONDS - t0)) s"
XLA_FLAGS=--xla_gpu_exhaustive_tiling_search=true timeout $((440 - SECONDS + t0)) python3 -P benchmarks/decode_bench.py --out $tmp/dec_exhaustive --batch 256 --context 1024 --steps 12 --profile-steps 0 --no-plot > $tmp/dec_exhaustive.log 2>&1; echo "rc=$?"; grep "^|" $tmp/dec_exhaustive/decode.md | tail -1; grep -i "prefill_s\|warm" $tmp/dec_exhaustive.log | tail -2; pack
echo "=== end at $((SECONDS - t0)) s"
