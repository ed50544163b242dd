#!/usr/bin/env bash
# Session 10, call 7 (4 GPUs): e2e_bench decode with --device-time at TP 4 (wall and device
# tables side by side), and the refactored decode TP probe once.
set -u
final=$OUT; tmp=/tmp/s10c7; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s10_call7.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
timeout 280 python3 -P benchmarks/e2e_bench.py --out $tmp/e2e --models llama3-70b --tp 4 --no-prefill --decode-tokens 1 16 64 --layers 8 --iters 10 --device-time 10 --time-budget 230 > $tmp/e2e.txt 2>&1
echo "e2e rc=$? at $((SECONDS - t0)) s"; cat $tmp/e2e/e2e.md 2>/dev/null | tail -22; pack
timeout 90 python3 -P benchmarks/probes/decode_tp_profile_probe.py --tp 4 --batch 16 --iters 10 --out $tmp/dtp > $tmp/dtp.log 2>&1
echo "probe rc=$? at $((SECONDS - t0)) s"; grep "^|" $tmp/dtp.log; tail -3 $tmp/dtp.log
echo "=== end at $((SECONDS - t0)) s"; pack
