#!/usr/bin/env bash
# Session 7, call 6 on one H200: decode_bench at TP 1 with the engine's default schedule (weave:
# the one-rank fused add + RMSNorm kernel, token-sharded residual) against baseline (XLA's
# add + norm fusions), runs alternated.
set -u
final=$OUT; tmp=/tmp/s7c6; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
for run in baseline:1 weave:1 baseline:2 weave:2; do
  s=${run%:*}; n=${run#*:}
  left=$((585 - SECONDS + t0)); [ $left -lt 100 ] && break
  echo "=== $s $n at $((SECONDS - t0)) s"
  timeout $left python3 -P benchmarks/decode_bench.py --schedule $s --out $tmp/dec_${s}_$n --profile-steps 0 --no-plot > $tmp/dec_${s}_$n.log 2>&1; echo "rc=$?"; grep "^| [0-9]" $tmp/dec_${s}_$n/decode.md | cut -d'|' -f2-9; pack
done
echo "=== end at $((SECONDS - t0)) s"
