#!/usr/bin/env bash
# Session 2026-11-27 (fourth), call 7 on nvidia-h200-x4: Mixtral at TP 4 checked against a
# float32 copy of its weights; loopback N = 2 with the replicated residual on 128 CTAs.
set -u
final=$OUT; tmp=/tmp/s12c7; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s12_call7.sh $tmp/
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"; rm -rf $tmp/build
for run in 1 2; do for c in 64 128; do
  timeout 30 python3 -P benchmarks/loopback_bench.py --ranks 2 --tokens 1 16 --algos one_shot --ctas $c --residual replicated --out $tmp/lb_rep_${c}_$run > $tmp/lb_rep_${c}_$run.log 2>&1; echo "lb replicated $c $run rc=$?"
  grep "^|" $tmp/lb_rep_${c}_$run/*.md | grep -v -- "---" | grep -v "^| N" | cut -d'|' -f2-3,7,9 | tr '\n' ';'; echo
done; done; pack
timeout $((570 - (SECONDS - t0))) python3 -P benchmarks/e2e_bench.py --out $tmp/e2e --models mixtral-8x22b --tp 4 --tokens 2048 8192 --decode-tokens 1 16 --layers 8 --iters 5 --time-budget 330 > $tmp/e2e.txt 2>&1; echo "e2e rc=$? at $((SECONDS - t0)) s"
grep -v "^|---" $tmp/e2e/e2e.md | grep "^|\|^##\|^\["
python3 -c "
import json; d=json.load(open('$tmp/e2e/e2e.json'))
for r in d['records']: print(r['kind'], r['tokens'], r['mode'], r['status'], r.get('rel_err'), r.get('rel_err_f32'))"
pack
echo "=== end at $((SECONDS - t0)) s"
