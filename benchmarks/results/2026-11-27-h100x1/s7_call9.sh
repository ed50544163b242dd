#!/usr/bin/env bash
# Session 7, call 9 on one H100 (nvidia-h100-x1): decode_bench's default sweep (the engine's
# default schedule, the serial floor, the SM clock) and prefill_bench, at HEAD.
set -u
final=$OUT; tmp=/tmp/s7c9; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $tmp/gpu.txt 2>&1; cat $tmp/gpu.txt
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
echo "=== decode at $((SECONDS - t0)) s"
timeout 330 python3 -P benchmarks/decode_bench.py --out $tmp/dec --profile-steps 0 > $tmp/dec.log 2>&1; echo "rc=$?"; grep "^|\|matmul" $tmp/dec/decode.md | head -6; pack
echo "=== prefill at $((SECONDS - t0)) s"
timeout $((585 - SECONDS + t0)) python3 -P benchmarks/prefill_bench.py --out $tmp/prefill --iters 3 > $tmp/prefill.log 2>&1; echo "rc=$?"; grep "^| [0-9]" $tmp/prefill/*.md | head -4; pack
echo "=== end at $((SECONDS - t0)) s"
