#!/usr/bin/env bash
# Session 2026-11-27 (fourth), call 1 on nvidia-h200-x4: the replicated residual
# (wip/replicated-residual = main d42a7d8 + replicated_residual.patch) on real peers and on
# the loopback harness; GPU tests first.
set -u
final=$OUT; tmp=/tmp/s12c1; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s12_call1.sh .scratch/replicated_residual.patch $tmp/
git apply .scratch/replicated_residual.patch || { echo "patch failed"; exit 1; }
(nvidia-smi -L; nvidia-smi topo -m; env | grep -E 'NVLS|MULTICAST' | sort) > $tmp/env.log 2>&1; head -5 $tmp/env.log
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
timeout 230 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_residual_replicated_gpu.py tests/test_ffi_gpu.py tests/test_loopback_gpu.py > $tmp/tests.log 2>&1; echo "tests rc=$? at $((SECONDS - t0)) s"; tail -4 $tmp/tests.log
pack
timeout 170 python3 -P benchmarks/kernel_bench.py --tp 2 4 --hidden 8192 --tokens 1 16 64 --ctas 64 128 --algos one_shot --impls ffi ffi_replicated xla --reps 10 --device-time --time-budget 150 --out $tmp/kernel > $tmp/kernel.log 2>&1; echo "kernel rc=$? at $((SECONDS - t0)) s"
grep -A40 "Best per impl" $tmp/kernel/kernel_bench.md
pack
for run in 1 2; do for res in sharded replicated; do
  [ $((SECONDS - t0)) -gt 540 ] && break 2
  timeout 30 python3 -P benchmarks/loopback_bench.py --ranks 2 --tokens 1 16 --algos one_shot --ctas 64 --residual $res --out $tmp/lb_${res}_$run > $tmp/lb_${res}_$run.log 2>&1; echo "lb $res $run rc=$?"
  grep "^|" $tmp/lb_${res}_$run/*.md | grep -v -- "---" | grep -v "^| N" | cut -d'|' -f2-3,7,9 | tr '\n' ';'; echo
done; pack; done
echo "=== end at $((SECONDS - t0)) s"
