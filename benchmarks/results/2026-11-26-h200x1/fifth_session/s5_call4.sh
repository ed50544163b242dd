#!/usr/bin/env bash
# Session 5, call 4: programmatic launches of the decode fused kernels (EXP_PDL), A/B.
set -u
final=$OUT; tmp=/tmp/s5c4; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
git apply .scratch/exp_pdl.patch || exit 1
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
for v in off on; do
  [[ $v == on ]] && export EXP_PDL=1 || unset EXP_PDL
  echo "=== loopback $v at $((SECONDS - t0)) s"
  timeout 60 python3 -P benchmarks/loopback_bench.py --out $tmp/lb16_$v --ranks 2 8 --tokens 1 16 --algos one_shot --ctas 16 > $tmp/lb16_$v.log 2>&1; echo "rc=$?"; grep "^|" $tmp/lb16_$v/*.md | head -8
  timeout 40 python3 -P benchmarks/loopback_bench.py --out $tmp/lb64_$v --ranks 2 --tokens 16 --algos one_shot --ctas 64 > $tmp/lb64_$v.log 2>&1; echo "rc=$?"; grep "^|" $tmp/lb64_$v/*.md | head -4; pack
  echo "=== profile N=1 $v at $((SECONDS - t0)) s"
  timeout 70 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 1 16 64 256 --out $tmp/prof_$v > $tmp/prof_$v.log 2>&1; echo "rc=$?"; grep "^|" $tmp/prof_$v/*.md | cut -c1-120; pack
done
export EXP_PDL=1
echo "=== tests with EXP_PDL at $((SECONDS - t0)) s"
timeout $((570 - SECONDS + t0)) python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_loopback_gpu.py tests/test_fused_one_rank_gpu.py tests/test_cmdbuffer_gpu.py > $tmp/tests_pdl.log 2>&1; echo "rc=$?"; tail -5 $tmp/tests_pdl.log; pack
echo "=== end at $((SECONDS - t0)) s"
