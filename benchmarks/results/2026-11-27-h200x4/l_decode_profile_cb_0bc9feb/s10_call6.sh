#!/usr/bin/env bash
# Session 10, call 6 (4 GPUs): the decode TP profile probe with idle gaps by length, at TP 4,
# with XLA's default command buffers and without them.
set -u
final=$OUT; tmp=/tmp/s10c6; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s10_call6.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for cb in default off; do
  if [ $cb = off ]; then export XLA_FLAGS=--xla_gpu_enable_command_buffer=; else unset XLA_FLAGS; fi
  timeout 200 python3 -P benchmarks/probes/decode_tp_profile_probe.py --tp 4 --out $tmp/dtp_tp4_cb_$cb > $tmp/dtp_tp4_cb_$cb.log 2>&1
  echo "probe cb=$cb rc=$? at $((SECONDS - t0)) s"; grep "^|" $tmp/dtp_tp4_cb_$cb.log; pack
done
echo "=== end at $((SECONDS - t0)) s"; pack
