#!/usr/bin/env bash
# Session 7, call 4 on one H200 (warm, built in call 3 at 5af0617 + the env-gated experiment
# patch, which is not set here): decode_bench's default sweep with the SM clock and power.
set -u
final=$OUT; tmp=/tmp/s7c4; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
git apply .scratch/exp_cut2.patch
python3 -m pip install --no-build-isolation --no-deps -e . > $tmp/install.log 2>&1 || tail -5 $tmp/install.log
echo "=== decode at $((SECONDS - t0)) s"
timeout 500 python3 -P benchmarks/decode_bench.py --out $tmp/dec --profile-steps 0 --no-plot > $tmp/dec.log 2>&1; echo "rc=$?"; grep "^|" $tmp/dec/decode.md | head -6; pack
echo "=== end at $((SECONDS - t0)) s"
