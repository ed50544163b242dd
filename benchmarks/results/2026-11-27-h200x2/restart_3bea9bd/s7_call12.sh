#!/usr/bin/env bash
# Session 7, call 12 on two GPUs: a restart at TP 2 with the engine's default schedule (weave,
# the fused kernel on both GPUs) at 3bea9bd: two starts of the same model, Llama-3.3-70B
# shapes, 8 layers, small workload.
set -u
final=$OUT; tmp=/tmp/s7c12; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
nvidia-smi --query-gpu=name --format=csv > $tmp/gpu.txt 2>&1
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
for i in 1 2; do
  left=$((290 - SECONDS + t0)); [ $left -lt 20 ] && break
  echo "=== start $i at $((SECONDS - t0)) s"
  timeout $left python3 -P benchmarks/serve_bench.py --model llama3-70b --layers 8 --tp 2 --workloads all-at-once --schedules weave --num-requests 16 --prompt-len 128 1024 --output-len 16 16 --no-plot --out $tmp/restart$i > $tmp/restart$i.log 2>&1; echo "rc=$?"; grep "^Warm-up\|^| all" $tmp/restart$i/*.md; pack
done
echo "=== end at $((SECONDS - t0)) s"
