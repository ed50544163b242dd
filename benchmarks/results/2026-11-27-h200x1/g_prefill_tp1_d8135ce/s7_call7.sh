#!/usr/bin/env bash
# Session 7, call 7 on one H200: prefill at TP 1 with the engine's default schedule (weave:
# steps of >= 2048 rows split in two halves, with nothing to communicate) against weave with no
# split (--split-threshold 1000000000) and baseline, each against its bare stack.
set -u
final=$OUT; tmp=/tmp/s7c7; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
for v in weave nosplit baseline; do
  left=$((585 - SECONDS + t0)); [ $left -lt 60 ] && break
  echo "=== $v at $((SECONDS - t0)) s"
  case $v in
    weave) opts="--schedule weave" ;;
    nosplit) opts="--schedule weave --split-threshold 1000000000" ;;
    baseline) opts="--schedule baseline" ;;
  esac
  timeout $left python3 -P benchmarks/prefill_bench.py $opts --out $tmp/prefill_$v --iters 3 > $tmp/prefill_$v.log 2>&1; echo "rc=$?"; grep "^| [0-9]" $tmp/prefill_$v/*.md | head -4; pack
done
echo "=== end at $((SECONDS - t0)) s"
