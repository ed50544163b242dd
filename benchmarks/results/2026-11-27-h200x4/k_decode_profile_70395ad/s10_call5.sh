#!/usr/bin/env bash
# Session 10, call 5 (4 GPUs): where a TP decode step's time goes per GPU
# (benchmarks/probes/decode_tp_profile_probe.py), Llama-3.3-70B shapes, 8 layers, TP 4 then
# TP 2; then the TP 4 breakdown of qwen2.5-72b at 4096 tokens if time is left.
set -u
final=$OUT; tmp=/tmp/s10c5; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s10_call5.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
tar xzf $tmp/build/session.tgz -C $tmp env.log 2>/dev/null; rm -rf $tmp/build
for tp in 4 2; do
  timeout 200 python3 -P benchmarks/probes/decode_tp_profile_probe.py --tp $tp --out $tmp/dtp_tp$tp > $tmp/dtp_tp$tp.log 2>&1
  echo "probe tp$tp rc=$? at $((SECONDS - t0)) s"; grep "^|" $tmp/dtp_tp$tp.log; pack
done
left=$((540 - (SECONDS - t0)))
if [ $left -gt 120 ]; then
  timeout $left python3 -P benchmarks/breakdown.py --model qwen2.5-72b --tp 4 --layers 8 --tokens 4096 --out $tmp/breakdown_qwen_tp4 > $tmp/breakdown_qwen_tp4.log 2>&1
  echo "breakdown rc=$? at $((SECONDS - t0)) s"; cat $tmp/breakdown_qwen_tp4/breakdown.md 2>/dev/null | head -30
fi
echo "=== end at $((SECONDS - t0)) s"; pack
