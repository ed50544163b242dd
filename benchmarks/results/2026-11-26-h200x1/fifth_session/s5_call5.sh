#!/usr/bin/env bash
# Session 5, call 5: programmatic launches, dependents allowed after the poll (EXP_PDL), A/B;
# then the clean HEAD: attention sweep and decode steps (issue 18's figures).
set -u
final=$OUT; tmp=/tmp/s5c5; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
git apply .scratch/exp_pdl_late.patch || exit 1
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
for v in off on; do
  [[ $v == on ]] && export EXP_PDL=1 || unset EXP_PDL
  echo "=== loopback $v at $((SECONDS - t0)) s"
  timeout 45 python3 -P benchmarks/loopback_bench.py --out $tmp/lb16_$v --ranks 2 8 --tokens 1 16 --algos one_shot --ctas 16 > $tmp/lb16_$v.log 2>&1; echo "rc=$?"; grep "^|" $tmp/lb16_$v/*.md | head -8
  timeout 30 python3 -P benchmarks/loopback_bench.py --out $tmp/lb64_$v --ranks 2 --tokens 1 16 --algos one_shot --ctas 64 > $tmp/lb64_$v.log 2>&1; echo "rc=$?"; grep "^|" $tmp/lb64_$v/*.md | head -4; pack
done
echo "=== loopback tests with EXP_PDL at $((SECONDS - t0)) s"
timeout 100 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_loopback_gpu.py > $tmp/tests_pdl.log 2>&1; echo "rc=$?"; tail -3 $tmp/tests_pdl.log; pack
unset EXP_PDL
git apply -R .scratch/exp_pdl_late.patch || exit 1
echo "=== rebuild clean at $((SECONDS - t0)) s"; python3 -m pip install --no-build-isolation --no-deps -e . > $tmp/build_clean.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
echo "=== attention at $((SECONDS - t0)) s"
timeout 90 python3 -P benchmarks/attention_bench.py --out $tmp/att --no-prefill --impls cuda --iters 5 --profile 3 --no-plot --batch 1 16 32 64 256 --context 1024 8192 > $tmp/att.log 2>&1; echo "rc=$?"; grep "^|" $tmp/att/attention.md | head -14; pack
echo "=== decode at $((SECONDS - t0)) s"
timeout $((590 - SECONDS + t0)) python3 -P benchmarks/decode_bench.py --out $tmp/dec --batch 1 64 256 --context 1024 --steps 12 --profile-steps 0 --no-plot > $tmp/dec.log 2>&1; echo "rc=$?"; grep "^|" $tmp/dec/decode.md | head -6; pack
echo "=== end at $((SECONDS - t0)) s"
