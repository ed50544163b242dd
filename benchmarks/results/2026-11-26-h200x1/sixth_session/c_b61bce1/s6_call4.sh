#!/usr/bin/env bash
# Session 6, call 4 on one H200 (HEAD): the paged-attention GPU tests that call 2's cap cut off;
# the batch-256 decode step profiled without cProfile (GPU busy time against wall time).
set -u
final=$OUT; tmp=/tmp/s6c4; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
echo "=== build"; env STAGES=build OUT=$tmp/build bash benchmarks/gpu_session.sh > $tmp/build.log 2>&1; echo "rc=$? at $((SECONDS - t0)) s"
echo "=== paged tests at $((SECONDS - t0)) s"
timeout 240 python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_paged_attention_gpu.py -k "padding_rows or cut_by_live or engine_serves or auto_takes or unavailable or split_step" > $tmp/tests_paged_rest.log 2>&1; echo "rc=$?"; tail -3 $tmp/tests_paged_rest.log; pack
echo "=== decode profile at $((SECONDS - t0)) s"
timeout $((590 - SECONDS + t0)) python3 -P benchmarks/decode_bench.py --out $tmp/dec256 --batch 256 --context 1024 --steps 12 --profile-steps 20 --no-host-profile --no-plot > $tmp/dec256.log 2>&1; echo "rc=$?"; grep "^|" $tmp/dec256/decode.md | head -4
python3 - $tmp/dec256/decode.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["records"][0]; p = r["profile"]
print({k: round(p[k], 3) for k in ("wall_ms", "busy_ms", "gap_ms", "kernel_ms", "launches_per_step")}, p["idle_gaps"]["classes_us"])
for k in p["kernels"][:12]: print(round(k["ms_per_step"], 3), k["calls_per_step"], k["name"][:60])
PY
pack
echo "=== end at $((SECONDS - t0)) s"
