#!/usr/bin/env bash
# Session 5, call 8 on one H200 (HEAD): paged-attention GPU tests after the launch refactor;
# e2e decode TP 1 (weave-ffi vs baseline) with programmatic launches.
set -u
final=$OUT; tmp=/tmp/s5c8; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
echo "=== tests at $((SECONDS - t0)) s"
timeout 270 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_paged_attention_gpu.py tests/test_rope_cache_gpu.py > $tmp/tests.log 2>&1; echo "rc=$?"; tail -4 $tmp/tests.log; pack
echo "=== e2e at $((SECONDS - t0)) s"
timeout $((590 - SECONDS + t0)) python3 -P benchmarks/e2e_bench.py --out $tmp/e2e --models llama3-8b --tp 1 --layers 32 --no-prefill --decode-tokens 1 64 256 --decode-modes baseline weave-ffi --iters 5 > $tmp/e2e.log 2>&1; echo "rc=$?"; grep "^|" $tmp/e2e/e2e.md 2>/dev/null | head -12; pack
echo "=== end at $((SECONDS - t0)) s"
