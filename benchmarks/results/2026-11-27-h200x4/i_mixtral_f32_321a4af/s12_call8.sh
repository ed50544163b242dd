#!/usr/bin/env bash
# Session 2026-11-27 (fourth), call 8 on nvidia-h200-x4 at 321a4af: Mixtral at TP 4 checked
# against float32 outputs computed before timing; if it crashes, the decode points again with
# XLA's command buffers off (to tell the capture race from the rest).
set -u
final=$OUT; tmp=/tmp/s12c8; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s12_call8.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
timeout 250 python3 -P benchmarks/e2e_bench.py --out $tmp/e2e --models mixtral-8x22b --tp 4 --tokens 2048 8192 --decode-tokens 1 16 --layers 8 --iters 5 --time-budget 200 > $tmp/e2e.txt 2>&1; rc=$?; echo "e2e rc=$rc at $((SECONDS - t0)) s"
grep -v "^|---" $tmp/e2e/e2e.md 2>/dev/null | grep "^|\|^##\|^\["; grep -B2 -A3 "Error\|error" $tmp/e2e.txt | head -20
pack
if [ $rc -ne 0 ] && [ $((SECONDS - t0)) -lt 420 ]; then
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout $((560 - (SECONDS - t0))) python3 -P benchmarks/e2e_bench.py --out $tmp/e2e_nocb --models mixtral-8x22b --tp 4 --no-prefill --decode-tokens 1 16 --layers 8 --iters 5 --time-budget 100 > $tmp/e2e_nocb.txt 2>&1; echo "e2e (no command buffers) rc=$? at $((SECONDS - t0)) s"
  grep -v "^|---" $tmp/e2e_nocb/e2e.md 2>/dev/null | grep "^|\|^##\|^\["
fi
python3 -c "
import json, glob
for f in glob.glob('$tmp/e2e*/e2e.json'):
    for r in json.load(open(f))['records']: print(f.split('/')[-2], r['kind'], r['tokens'], r['mode'], r['status'], r.get('rel_err'), r.get('rel_err_f32'))"
pack
echo "=== end at $((SECONDS - t0)) s"
