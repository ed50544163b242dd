#!/usr/bin/env bash
# Session 10, call 8 (4 GPUs): is the fused call's skew paid at a step's first call? The decode
# TP probe at TP 4, batch 16, weave-ffi and nocomm, with 8 and 32 layers.
set -u
final=$OUT; tmp=/tmp/s10c8; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s10_call8.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for layers in 8 32; do
  timeout 150 python3 -P benchmarks/probes/decode_tp_profile_probe.py --tp 4 --layers $layers --batch 1 16 --modes nocomm weave-ffi --iters 10 --out $tmp/dtp_l$layers > $tmp/dtp_l$layers.log 2>&1
  echo "probe layers=$layers rc=$? at $((SECONDS - t0)) s"; grep "^|" $tmp/dtp_l$layers.log; pack
done
echo "=== end at $((SECONDS - t0)) s"; pack
