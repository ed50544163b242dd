#!/usr/bin/env bash
# Session 10, call 1 (one H200): benchmarks/probes/l2_prefetch_probe.py, the premise of a fused
# call that prefetches the next GEMM's weight into L2 while it waits.
#   - Llama-3-8B at TP 1: gate/up [4096, 28672] and QKV [4096, 6144]; the wait is the one-rank
#     call (2 us) and a loopback N = 2 call (4 us).
#   - Llama-3.3-70B at TP 4: gate/up [8192, 14336]; a TP 4 collective's wait (6 us).
set -u
final=$OUT; tmp=/tmp/s10c1; mkdir -p $tmp; t0=$SECONDS
export PYTHONUNBUFFERED=1
pack() { tar czf $final/all.tgz -C $tmp . 2>/dev/null; }
cp .scratch/s10_call1.sh $tmp/
nvidia-smi -L > $tmp/env.log; python3 -c 'import torch; print(torch.__version__)' >> $tmp/env.log 2>&1
P=benchmarks/probes/l2_prefetch_probe.py
run() { name=$1; shift; timeout 150 python3 -P $P "$@" --out $tmp/$name.json > $tmp/$name.log 2>&1; echo "$name rc=$? at $((SECONDS - t0)) s"; cat $tmp/$name.log | grep "M="; pack; }
run gu8b_w2 --k 4096 --n 28672 --rows 1 64 --mib 0 2 4 8 16 --wait-us 2
run gu8b_w4 --k 4096 --n 28672 --rows 1 --mib 0 4 8 16 32 --wait-us 4
run qkv8b_w2 --k 4096 --n 6144 --rows 1 64 --mib 0 2 4 8 16 --wait-us 2
run gu70b_w6 --k 8192 --n 14336 --rows 1 16 64 --mib 0 8 16 24 32 48 --wait-us 6
run gu70b_w6_c64 --k 8192 --n 14336 --rows 1 --mib 0 16 32 --wait-us 6 --ctas 64
echo "=== end at $((SECONDS - t0)) s"; pack
