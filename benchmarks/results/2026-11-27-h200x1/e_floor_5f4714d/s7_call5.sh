#!/usr/bin/env bash
# Session 7, call 5 on one H200: decode_bench's default sweep with the SM clock / power and the
# serial floor (5f4714d), then batch 256 twice more (the spread on one machine).
set -u
final=$OUT; tmp=/tmp/s7c5; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
nvidia-smi --query-gpu=power.draw.instant,power.draw.average,power.draw --format=csv > $tmp/power_fields.txt 2>&1; cat $tmp/power_fields.txt
echo "=== decode at $((SECONDS - t0)) s"
timeout 300 python3 -P benchmarks/decode_bench.py --out $tmp/dec --profile-steps 0 --no-plot > $tmp/dec.log 2>&1; echo "rc=$?"; grep "^|\|matmul" $tmp/dec/decode.md | head -6; pack
for n in 2 3; do
  left=$((580 - SECONDS + t0)); [ $left -lt 60 ] && break
  echo "=== decode 256 #$n at $((SECONDS - t0)) s"
  timeout $left python3 -P benchmarks/decode_bench.py --out $tmp/dec256_$n --batch 256 --profile-steps 0 --no-plot > $tmp/dec256_$n.log 2>&1; echo "rc=$?"; grep "^| 256" $tmp/dec256_$n/decode.md; pack
done
echo "=== end at $((SECONDS - t0)) s"
