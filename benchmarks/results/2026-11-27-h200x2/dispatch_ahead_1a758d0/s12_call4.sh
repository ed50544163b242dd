#!/usr/bin/env bash
# Session 12, call 4 (2 GPUs): does dispatching decode steps ahead, as a server does, make the
# fused call pay at TP 2 as it does at TP 4 (call 3)? e2e_bench with --device-time, waiting for
# each step (--dispatch-ahead 1) and with 4 steps ahead.
set -u
final=$OUT; tmp=/tmp/s12c4; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s12_call4.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for ahead in 1 4; do
  timeout 200 python3 -P benchmarks/e2e_bench.py --out $tmp/e2e_ahead$ahead --models llama3-70b --tp 2 --no-prefill --decode-tokens 1 16 64 --layers 8 --iters 10 --device-time 10 --dispatch-ahead $ahead --time-budget 170 > $tmp/e2e_ahead$ahead.txt 2>&1
  echo "e2e ahead=$ahead rc=$? at $((SECONDS - t0)) s"; tail -14 $tmp/e2e_ahead$ahead/e2e.md; pack
done
echo "=== end at $((SECONDS - t0)) s"; pack
