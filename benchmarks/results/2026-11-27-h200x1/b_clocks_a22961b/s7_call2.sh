#!/usr/bin/env bash
# Session 7, call 2 on one H200: SM clock, power and temperature (nvidia-smi every 50 ms)
# during the decode-projection probe and during the engine's batch-256 decode step, profiled.
set -u
final=$OUT; tmp=/tmp/s7c2; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
smi() { nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader -lms 50 > $tmp/$1.smi.csv 2>&1 & echo $!; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
nvidia-smi -q -d CLOCK,POWER,TEMPERATURE > $tmp/smi_q.txt 2>&1
echo "=== probe at $((SECONDS - t0)) s"
pid=$(smi probe); python3 -P benchmarks/probes/gemm_pick_probe.py --mode nosplit --steps 1000 --out $tmp/probe.json > $tmp/probe.log 2>&1; echo "rc=$?"; kill $pid
grep "^==\|^ " $tmp/probe.log | head -6; pack
echo "=== decode 256 at $((SECONDS - t0)) s"
pid=$(smi dec256); timeout 300 python3 -P benchmarks/decode_bench.py --out $tmp/dec256 --batch 256 --context 1024 --steps 12 --profile-steps 20 --no-host-profile --no-plot > $tmp/dec256.log 2>&1; echo "rc=$?"; kill $pid
grep "^|" $tmp/dec256/decode.md | head -4
python3 - $tmp/dec256/decode.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["records"][0]; p = r["profile"]
print({k: round(p[k], 3) for k in ("wall_ms", "busy_ms", "gap_ms", "kernel_ms", "launches_per_step")})
for k in p["kernels"][:12]: print(round(k["ms_per_step"], 3), k["calls_per_step"], round(k["us_per_launch_min_p50_max"][1], 1), k["name"][:60])
PY
pack
echo "=== probe again (hot) at $((SECONDS - t0)) s"
pid=$(smi probe2); python3 -P benchmarks/probes/gemm_pick_probe.py --mode nosplit --steps 1000 --out $tmp/probe2.json > $tmp/probe2.log 2>&1; echo "rc=$?"; kill $pid
grep "^==\|^ " $tmp/probe2.log | head -6; pack
echo "=== end at $((SECONDS - t0)) s"
