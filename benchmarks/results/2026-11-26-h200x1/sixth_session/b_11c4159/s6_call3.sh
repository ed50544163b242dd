#!/usr/bin/env bash
# Session 6, call 3 (same warm machine as call 2, HEAD): serving workload of issue 18, then two
# restarts of the same model (warm-up from the persistent compilation cache).
set -u
final=$OUT; tmp=/tmp/s6c3; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
python3 -c "import jax_tokenweave" 2>/dev/null || { env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "build rc=$?"; }
echo "=== serve at $((SECONDS - t0)) s"
timeout 330 python3 -P benchmarks/serve_bench.py --model llama3-8b --layers 32 --tp 1 --workloads all-at-once --schedules baseline --num-requests 256 --prompt-len 128 1024 --output-len 128 128 --no-plot --out $tmp/serve > $tmp/serve.log 2>&1; echo "rc=$?"; grep "^|" $tmp/serve/*.md | head -8; grep -i "warm" $tmp/serve.log | tail -3; pack
for i in 1 2; do
  echo "=== restart $i at $((SECONDS - t0)) s"
  timeout $((590 - SECONDS + t0)) python3 -P benchmarks/serve_bench.py --model llama3-8b --layers 32 --tp 1 --workloads all-at-once --schedules baseline --num-requests 8 --prompt-len 128 256 --output-len 16 16 --no-plot --out $tmp/restart$i > $tmp/restart$i.log 2>&1; echo "rc=$?"; grep -i "warm" $tmp/restart$i.log | tail -2; pack
done
echo "=== end at $((SECONDS - t0)) s"
