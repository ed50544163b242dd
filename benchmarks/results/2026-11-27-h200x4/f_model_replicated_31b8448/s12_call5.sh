#!/usr/bin/env bash
# Session 2026-11-27 (fourth), call 5 on nvidia-h200-x4 at main 31b8448: the model with the
# replicated residual on whole decode batches. GPU tests of the weave schedule, e2e decode
# (weave-ffi = replicated, weave-ffi-sync = token-sharded) at TP 2 and 4, serving at TP 4.
set -u
final=$OUT; tmp=/tmp/s12c5; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s12_call5.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
timeout 100 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_weave_overlap.py -k gpu > $tmp/tests.log 2>&1; echo "tests rc=$? at $((SECONDS - t0)) s"; tail -3 $tmp/tests.log
pack
timeout 230 python3 -P benchmarks/e2e_bench.py --out $tmp/e2e --models llama3-70b --tp 2 4 --no-prefill --decode-tokens 1 16 64 --layers 8 --iters 10 --time-budget 200 > $tmp/e2e.txt 2>&1; echo "e2e rc=$? at $((SECONDS - t0)) s"
grep -v "^|---" $tmp/e2e/e2e.md | grep "^|\|^##"
pack
left=$((565 - (SECONDS - t0))); echo "serve with ${left} s left"
[ $left -gt 120 ] && (export OUT=$tmp/serve_tp4 TP=4 SKIP_INSTALL=1 SERVE_ARGS="--workloads all-at-once --num-requests 128 --prompt-len 128 1024 --output-len 128 128 --no-plot"; timeout $left bash benchmarks/gpu_serve.sh > $tmp/serve_tp4.log 2>&1; echo "serve rc=$?"; grep -v "^|---" $tmp/serve_tp4/serve.md 2>/dev/null | grep "^|" | head -12)
pack
echo "=== end at $((SECONDS - t0)) s"
