#!/usr/bin/env bash
# Session 5, call 1: build, paged-attention GPU tests (clean), decode attention A vs head-major pages.
set -u
final=$OUT; tmp=/tmp/s5c1; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
ATT="--no-prefill --impls cuda --iters 5 --profile 3 --no-plot --batch 16 256 --context 1024 8192"
att() { echo "=== attention $1 at $((SECONDS - t0)) s"; timeout 70 python3 -P benchmarks/attention_bench.py --out $tmp/att_$1 $ATT > $tmp/att_$1.log 2>&1
  echo "rc=$?"; grep "^|" $tmp/att_$1/attention.md | head -8; pack; }
rebuild() { echo "=== rebuild $1 at $((SECONDS - t0)) s"; python3 -m pip install --no-build-isolation --no-deps -e . > $tmp/build_$1.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
echo "=== tests at $((SECONDS - t0)) s"
timeout 170 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_paged_attention_gpu.py > $tmp/tests.log 2>&1; echo "rc=$?"; tail -4 $tmp/tests.log; pack
att A
git apply .scratch/exp_headmajor.patch 2>/dev/null || patch -p1 < .scratch/exp_headmajor.patch
rebuild hm
EXP_HEADMAJOR=1 att Ahm
att Apatched
echo "=== end at $((SECONDS - t0)) s"
