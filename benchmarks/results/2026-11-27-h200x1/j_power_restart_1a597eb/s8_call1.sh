#!/usr/bin/env bash
# Session 8, call 1 on one H200: 4cf2685's narrower executable-cache key on a GPU (the restart
# test, then two starts of a weaving engine), and power_probe.py (read, copy, decode attention
# at 256 x 1024, the MLP GEMMs at M = 256, each alone, with nvidia-smi sampling).
set -u
final=$OUT; tmp=/tmp/s8c1; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s8_call1.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
nvidia-smi -q -d POWER,CLOCK > $tmp/smi_q.txt 2>&1
echo "=== power probe at $((SECONDS - t0)) s"
timeout 150 python3 -P benchmarks/probes/power_probe.py --seconds 6 --out $tmp/power.json > $tmp/power.log 2>&1; echo "rc=$?"; grep -E "^(read|copy|attention|gemm) " $tmp/power.log | cut -c1-400; pack
echo "=== test at $((SECONDS - t0)) s"
timeout 200 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_executable_cache_gpu.py > $tmp/test_exe_cache_gpu.log 2>&1; echo "rc=$?"; tail -3 $tmp/test_exe_cache_gpu.log; pack
for i in 1 2; do
  left=$((585 - SECONDS + t0)); [ $left -lt 60 ] && break
  echo "=== start $i at $((SECONDS - t0)) s"
  timeout $left python3 -P benchmarks/serve_bench.py --model llama3-8b --layers 32 --tp 1 --workloads all-at-once --schedules weave --num-requests 8 --prompt-len 128 256 --output-len 16 16 --no-plot --out $tmp/restart$i > $tmp/restart$i.log 2>&1; echo "rc=$?"; grep "^Warm-up" $tmp/restart$i/*.md; pack
done
echo "=== end at $((SECONDS - t0)) s"
