#!/usr/bin/env bash
# Session 6, call 2 on one H200 (HEAD): N = 1 per-call device time with calls kept apart
# (profile_kernels, kernel_bench --device-time); the paged-attention GPU tests not run since
# the launch refactor; decode steps; prefill steps.
set -u
final=$OUT; tmp=/tmp/s6c2; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
echo "=== profile at $((SECONDS - t0)) s"
timeout 90 python3 -P benchmarks/profile_kernels.py --tp 1 --tokens 1 16 32 64 256 --out $tmp/prof > $tmp/prof.log 2>&1; echo "rc=$?"; cat $tmp/prof/*.md 2>/dev/null | head -14; pack
echo "=== kernel_bench at $((SECONDS - t0)) s"
timeout 90 python3 -P benchmarks/kernel_bench.py --out $tmp/kb --tp 1 --hidden 8192 --tokens 1 16 64 256 --impls ffi xla --ctas policy --reps 5 --device-time > $tmp/kb.log 2>&1; echo "rc=$?"; grep "^|" $tmp/kb/*.md 2>/dev/null | head -14; pack
echo "=== paged tests at $((SECONDS - t0)) s"
timeout 150 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_paged_attention_gpu.py -k "prompt_tiles or padding_rows or cut_by_live or engine_serves or auto_takes or unavailable or split_step" > $tmp/tests_paged.log 2>&1; echo "rc=$?"; tail -3 $tmp/tests_paged.log; pack
echo "=== decode at $((SECONDS - t0)) s"
timeout 150 python3 -P benchmarks/decode_bench.py --out $tmp/dec --batch 1 64 256 --context 1024 --steps 12 --profile-steps 0 --no-plot > $tmp/dec.log 2>&1; echo "rc=$?"; grep "^|" $tmp/dec/decode.md | head -6; pack
echo "=== prefill at $((SECONDS - t0)) s"
timeout $((595 - SECONDS + t0)) python3 -P benchmarks/prefill_bench.py --out $tmp/prefill --iters 2 > $tmp/prefill.log 2>&1; echo "rc=$?"; grep "^|" $tmp/prefill/*.md | head -8; pack
echo "=== end at $((SECONDS - t0)) s"
