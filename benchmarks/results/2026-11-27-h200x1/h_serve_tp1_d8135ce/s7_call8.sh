#!/usr/bin/env bash
# Session 7, call 8 on one H200: issue 18's serving workload (256 requests at once, prompts
# U[128, 1024], 128 output tokens) at TP 1 with the engine's default schedule (weave) and with
# baseline, in one run.
set -u
final=$OUT; tmp=/tmp/s7c8; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
echo "=== serve at $((SECONDS - t0)) s"
timeout $((585 - SECONDS + t0)) python3 -P benchmarks/serve_bench.py --model llama3-8b --layers 32 --tp 1 --workloads all-at-once --schedules weave baseline --num-requests 256 --prompt-len 128 1024 --output-len 128 128 --no-plot --out $tmp/serve > $tmp/serve.log 2>&1; echo "rc=$?"; grep "^|" $tmp/serve/*.md | head -8; grep -i "warm" $tmp/serve.log | tail -3; pack
echo "=== end at $((SECONDS - t0)) s"
