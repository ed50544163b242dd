#!/usr/bin/env bash
# Session 5, call 3: evict-first L2 policy on decode K/V (EXP_EVICT), attention and decode steps A/B.
set -u
final=$OUT; tmp=/tmp/s5c3; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
ATT="--no-prefill --impls cuda --iters 5 --profile 3 --no-plot --batch 1 16 32 256 --context 1024"
att() { echo "=== attention $1 at $((SECONDS - t0)) s"; timeout 70 python3 -P benchmarks/attention_bench.py --out $tmp/att_$1 $ATT > $tmp/att_$1.log 2>&1
  echo "rc=$?"; grep "^|" $tmp/att_$1/attention.md | head -8; pack; }
git apply .scratch/exp_evict.patch || exit 1
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
att off1; EXP_EVICT=1 att on1; att off2; EXP_EVICT=1 att on2
for v in off on; do
  echo "=== decode $v at $((SECONDS - t0)) s"
  [[ $v == on ]] && export EXP_EVICT=1 || unset EXP_EVICT
  timeout 150 python3 -P benchmarks/decode_bench.py --out $tmp/dec_$v --batch 1 64 256 --context 1024 --steps 12 --profile-steps 0 --no-plot > $tmp/dec_$v.log 2>&1; echo "rc=$?"; grep "^|" $tmp/dec_$v/decode.md | head -6; pack
done
echo "=== end at $((SECONDS - t0)) s"
