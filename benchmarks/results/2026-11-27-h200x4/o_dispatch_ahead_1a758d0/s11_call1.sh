#!/usr/bin/env bash
# Next session, call 1 on 4 GPUs (prepared 2026-11-27, not yet run): does dispatching decode
# steps ahead, as a server does, remove the start-of-step skew that a step's first collective
# pays at TP 4? e2e_bench with --device-time, waiting for each step and with 4 steps ahead;
# then the decode TP probe at batch 16 with --ahead 4 (each group's first call apart).
set -u
final=$OUT; tmp=/tmp/s11c1; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s11_call1.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for ahead in 1 4; do
  timeout 200 python3 -P benchmarks/e2e_bench.py --out $tmp/e2e_ahead$ahead --models llama3-70b --tp 4 --no-prefill --decode-tokens 1 16 64 --layers 8 --iters 10 --device-time 10 --dispatch-ahead $ahead --time-budget 170 > $tmp/e2e_ahead$ahead.txt 2>&1
  echo "e2e ahead=$ahead rc=$? at $((SECONDS - t0)) s"; tail -14 $tmp/e2e_ahead$ahead/e2e.md; pack
done
timeout 90 python3 -P benchmarks/probes/decode_tp_profile_probe.py --tp 4 --batch 16 --modes nocomm weave-ffi baseline --iters 5 --ahead 4 --out $tmp/dtp_ahead4 > $tmp/dtp_ahead4.log 2>&1
echo "probe rc=$? at $((SECONDS - t0)) s"; grep "^|" $tmp/dtp_ahead4.log
echo "=== end at $((SECONDS - t0)) s"; pack
