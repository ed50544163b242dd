#!/usr/bin/env bash
# Session 6, call 1 on one H200 (HEAD): Nsight Compute on the N = 1 fused kernel and on XLA's
# add + RMSNorm fusions of the same chain (caches not flushed); profile_kernels smoke run
# (profile() returning Profile); the loopback GPU test file (free-running, 20 replays).
set -u
final=$OUT; tmp=/tmp/s6c1; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
mkdir -p $tmp/ncu
for t in 16 64; do
  for impl in ffi xla; do
    rep=$tmp/ncu/${impl}_t$t
    if [ $impl = ffi ]; then k='LocalRows'; skip=8; cnt=2; else k='fusion|convert'; skip=24; cnt=6; fi
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 90 ncu --clock-control none --cache-control none \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats \
      --kernel-name regex:"$k" --launch-skip $skip --launch-count $cnt -f -o $rep \
      python3 -P benchmarks/ncu_fused.py --impl $impl --tokens $t > $rep.log 2>&1; echo "ncu $impl T=$t rc=$?"
    ncu -i $rep.ncu-rep --page details --csv > $rep.details.csv 2>> $rep.log
    grep -E '"(Duration|Elapsed Cycles|SM Active Cycles|Registers Per Thread|Grid Size|Block Size|Cluster Size)"' $rep.details.csv | awk -F'","' '{print $5, $(NF-2), $(NF-1), $NF}' | head -40
  done
done
pack
echo "=== hlo at $((SECONDS - t0)) s"
XLA_FLAGS="--xla_dump_to=$tmp/hlo --xla_dump_hlo_as_text" timeout 60 python3 -P benchmarks/ncu_fused.py --impl xla --tokens 64 > $tmp/hlo.log 2>&1; echo "rc=$?"
find $tmp/hlo -name '*after_optimizations.txt' | grep -i chain | head; find $tmp/hlo -type f ! -name '*after_optimizations.txt' -delete
pack
echo "=== profile at $((SECONDS - t0)) s"
timeout 90 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 1 16 32 64 256 --out $tmp/prof > $tmp/prof.log 2>&1; echo "rc=$?"; cat $tmp/prof/*.md 2>/dev/null | head -14; pack
echo "=== loopback tests at $((SECONDS - t0)) s"
timeout $((590 - SECONDS + t0)) python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_loopback_gpu.py > $tmp/tests_loopback.log 2>&1; echo "rc=$?"; tail -4 $tmp/tests_loopback.log; pack
echo "=== end at $((SECONDS - t0)) s"
