#!/usr/bin/env bash
# Session 7, call 11 on one H200: the executable cache with the fused kernel (3bea9bd): the GPU
# restart test, then issue 18's restart figure with the engine's default schedule (weave, which
# calls the one-rank fused kernel at TP 1): two starts of the same model, small workload.
set -u
final=$OUT; tmp=/tmp/s7c11; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
echo "=== test at $((SECONDS - t0)) s"
timeout 200 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_executable_cache_gpu.py > $tmp/test_exe_cache_gpu.log 2>&1; echo "rc=$?"; tail -3 $tmp/test_exe_cache_gpu.log; pack
for i in 1 2; do
  left=$((585 - SECONDS + t0)); [ $left -lt 60 ] && break
  echo "=== start $i at $((SECONDS - t0)) s"
  timeout $left python3 -P benchmarks/serve_bench.py --model llama3-8b --layers 32 --tp 1 --workloads all-at-once --schedules weave --num-requests 8 --prompt-len 128 256 --output-len 16 16 --no-plot --out $tmp/restart$i > $tmp/restart$i.log 2>&1; echo "rc=$?"; grep "^Warm-up" $tmp/restart$i/*.md; pack
done
echo "=== end at $((SECONDS - t0)) s"
