#!/usr/bin/env bash
# Session 10, call 3 (one H200): Nsight Compute on the one-rank call at T = 64 (the landed pair
# of CTAs a row) against its traffic floor (exp_s10.patch, JAX_TOKENWEAVE_EXP_FLOOR=512 +
# _FLOOR_W=1: the same loads and stores without the reduction), caches kept (L2 warm, as in
# the profiled chain). Where does the pair's extra 0.9 us go?
set -u
final=$OUT; tmp=/tmp/s10c3; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s10_call3.sh .scratch/exp_s10.patch $tmp/
git apply .scratch/exp_s10.patch || { echo "patch failed"; exit 1; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
prof() { name=$1; t=$2; shift 2
  env "$@" timeout 150 ncu --clock-control none --cache-control none --set full --import-source yes \
    --kernel-name regex:'LocalRows|ExpFloor' --launch-skip 8 --launch-count 1 \
    -f -o $tmp/$name python3 -P benchmarks/ncu_fused.py --tp 1 --tokens $t > $tmp/$name.log 2>&1
  echo "$name rc=$? at $((SECONDS - t0)) s"
  ncu -i $tmp/$name.ncu-rep --page details --csv > $tmp/$name.details.csv 2>> $tmp/$name.log
  ncu -i $tmp/$name.ncu-rep --page source --csv --print-source sass > $tmp/$name.source.csv 2>> $tmp/$name.log
  ncu -i $tmp/$name.ncu-rep --page raw --csv > $tmp/$name.raw.csv 2>> $tmp/$name.log
  grep -E '"(Duration|Elapsed Cycles|SM Active Cycles|Registers Per Thread|Achieved Occupancy|L2 Hit Rate|Memory Throughput)"' $tmp/$name.details.csv | cut -d, -f12- | head -8
  pack; }
prof pair_t64 64 JAX_TOKENWEAVE_X=0
prof floorw_t64 64 JAX_TOKENWEAVE_EXP_FLOOR=512 JAX_TOKENWEAVE_EXP_FLOOR_W=1
prof pair_t32 32 JAX_TOKENWEAVE_X=0
prof block_t64 64 JAX_TOKENWEAVE_ROW_CTAS=1
echo "=== end at $((SECONDS - t0)) s"; pack
