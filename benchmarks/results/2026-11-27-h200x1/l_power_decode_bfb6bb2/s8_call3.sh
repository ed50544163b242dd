#!/usr/bin/env bash
# Session 8, call 3 on one H200: power_probe.py with calls kept in flight (call 1 waited on each
# call, so the GPU idled between them), then decode_bench at batch 256 with its clock column.
set -u
final=$OUT; tmp=/tmp/s8c3; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s8_call3.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for run in 1 2; do
  echo "=== power probe $run at $((SECONDS - t0)) s"
  timeout 150 python3 -P benchmarks/probes/power_probe.py --seconds 6 --out $tmp/power_$run.json > $tmp/power_$run.log 2>&1; echo "rc=$?"; grep -E "^(read|copy|attention|gemm) " $tmp/power_$run.log | cut -c1-330; pack
done
echo "=== decode 256 at $((SECONDS - t0)) s"
timeout 240 python3 -P benchmarks/decode_bench.py --out $tmp/dec256 --batch 256 --profile-steps 0 --no-plot > $tmp/dec256.log 2>&1; echo "rc=$?"; grep "^| 256" $tmp/dec256/decode.md; pack
echo "=== end at $((SECONDS - t0)) s"
