#!/usr/bin/env bash
# Session 7, call 1 on one H200: which GEMM kernels the decode projections get at 256 rows,
# per XLA option set, each in processes of its own (pick variance), and PyTorch's pick.
set -u
final=$OUT; tmp=/tmp/s7c1; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
python3 -m pip install --no-build-isolation --no-deps -e . > $tmp/install.log 2>&1 || tail -5 $tmp/install.log
for run in nosplit:1 cublas:1 level0:1 torch:1 nosplit:2 cublas:2 level0:2 nosplit:3 cublas:3 split:1; do
  mode=${run%:*}; n=${run#*:}
  left=$((560 - SECONDS + t0)); [ $left -lt 40 ] && break
  echo "=== $mode $n at $((SECONDS - t0)) s"
  timeout $((left < 120 ? left : 120)) python3 -P benchmarks/probes/gemm_pick_probe.py --mode $mode --out $tmp/${mode}_$n.json > $tmp/${mode}_$n.log 2>&1; echo "rc=$?"
  grep -v "^WARNING\|^I0000\|^E0000" $tmp/${mode}_$n.log | tail -9; pack
done
echo "=== end at $((SECONDS - t0)) s"
