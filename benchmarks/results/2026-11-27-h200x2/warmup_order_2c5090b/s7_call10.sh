#!/usr/bin/env bash
# Session 7, call 10 on two GPUs: the serving engine's first warm-up at TP 2 (Llama-3.3-70B
# shapes, 8 layers), each schedule first in a process of its own with a compilation cache of its
# own, then both in one process in the order baseline, weave (issue 22 ran weave first: 61.0 s
# against 17.3 s for baseline second).
set -u
final=$OUT; tmp=/tmp/s7c10; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
nvidia-smi --query-gpu=name --format=csv > $tmp/gpu.txt 2>&1; cat $tmp/gpu.txt
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
ARGS="--model llama3-70b --layers 8 --tp 2 --workloads all-at-once --num-requests 16 --prompt-len 128 1024 --output-len 16 16 --no-plot"
for run in baseline weave "baseline weave"; do
  name=$(echo $run | tr ' ' '_'); left=$((585 - SECONDS + t0)); [ $left -lt 60 ] && break
  echo "=== $name at $((SECONDS - t0)) s"
  JAX_COMPILATION_CACHE_DIR=/tmp/cc_$name timeout $left python3 -P benchmarks/serve_bench.py $ARGS --schedules $run --out $tmp/serve_$name > $tmp/serve_$name.log 2>&1; echo "rc=$?"
  grep "^Warm-up" $tmp/serve_$name/*.md; pack
done
echo "=== end at $((SECONDS - t0)) s"
