"""Probe (GPUs): where a TP decode step's time goes on each GPU, mode by mode.

The decode batches of ``e2e_bench.py`` (one token per request, Llama-3.3-70B shapes,
``--layers`` layers) in ``--modes`` (default baseline, nocomm, weave-ffi, weave-ffi-sync). Per
mode and batch, ``--iters`` steps run under PyTorch's profiler after three warm ones; per GPU:
busy time (the union of its kernels), idle time between kernels by the gap's length (short
gaps are launch latency, long ones the host between steps), kernels launched, and device time
by kernel class (``gemm``,
``fused`` collective, ``nccl``, ``other``). Each column shows the median over GPUs; busy time also
shows its min and max. The wall time is the host's per step.
Run: ``python3 -P benchmarks/probes/decode_tp_profile_probe.py --tp 4 --out DIR``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import jax

from jax_tokenweave.bench import benchmarking as bm
from jax_tokenweave.bench.modes import Mode, compile_forward, make_plan

_step_profile = bm.sibling_module(
    str(Path(__file__).resolve().parents[1] / "e2e_bench.py"), "step_profile"
)
MODES = {
    m.name: m
    for m in (Mode("baseline"), Mode("nocomm"), Mode("weave", "ffi"), Mode("weave", "ffi-sync"))
}
FUSED = ("OneShot", "LocalRows", "TwoShot", "Direct", "Fused")
GEMM = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "triton_dot")


def kernel_class(name: str) -> str:
    """``fused`` (this library's collective), ``nccl``, ``gemm`` or ``other``."""
    if "tokenweave" in name and any(k in name for k in FUSED):
        return "fused"
    if "nccl" in name.lower():
        return "nccl"
    return "gemm" if any(k in name.lower() for k in GEMM) else "other"


def per_gpu(run: Any, iters: int) -> tuple[float, dict[int, dict[str, float]]]:
    """Host ms per step and, per device: ``busy``, ``idle_<gap class>`` and each kernel class's
    us per step, and ``launches`` per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        jax.block_until_ready(run())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(iters):
            jax.block_until_ready(run())
        wall_ms = (time.perf_counter() - start) * 1e3 / iters
        torch.cuda.synchronize()
    spans: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
    out: dict[int, dict[str, float]] = collections.defaultdict(lambda: collections.Counter())
    for e in prof.events():
        if "CUDA" in str(getattr(e, "device_type", "")):
            spans[e.device_index].append((e.time_range.start, e.time_range.end, e.name[:60]))
            out[e.device_index][kernel_class(e.name)] += e.device_time_total / iters
    for dev, s in spans.items():
        out[dev]["busy"] = _step_profile.busy_us([(a, b) for a, b, _ in s]) / iters
        for size, us in _step_profile.idle_gaps(s)["classes_us"].items():
            out[dev][f"idle_{size}"] = us / iters  # between kernels, by the gap's length
        out[dev]["launches"] = len(s) / iters
    return wall_ms, {d: dict(v) for d, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-70b", help=bm.config_names_help())
    ap.add_argument("--tp", type=int, default=len(jax.devices()), help="tensor-parallel degree")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="decode rows")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--iters", type=int, default=20, help="profiled steps per point")
    ap.add_argument("--out", type=Path, default=Path("decode_tp_profile"))
    args = ap.parse_args()

    config = bm.load_config(args.model, args.layers)
    mesh = bm.make_mesh(jax.devices(), args.tp)
    dtype = bm.DTYPES["bfloat16"]
    decoder = bm.build_decoder(config, mesh, dtype, 0)
    rows, lines = [], []
    for batch in args.batch:
        hidden = bm.random_hidden(batch, config.hidden_size, dtype, mesh, 1 + batch)
        lengths = bm.request_lengths(batch, 1)
        for name in args.modes:
            mode = MODES[name]
            plan = make_plan(config, args.model, lengths, args.tp, split=mode.split)
            run, _, _ = compile_forward(
                decoder, plan, hidden, schedule=mode.schedule, collective=mode.collective
            )
            wall, gpus = per_gpu(run, args.iters)
            keys = ("busy", "idle_lt_2us", "idle_2_20us", "idle_ge_20us", "launches")
            med = {
                k: statistics.median(g.get(k, 0.0) for g in gpus.values())
                for k in (*keys, "gemm", "fused", "nccl", "other")
            }
            busy = sorted(g["busy"] for g in gpus.values())
            rows.append(dict(batch=batch, mode=name, wall_ms=wall, per_gpu=gpus, median=med))
            lines.append(
                f"| {batch} | {name} | {wall:.3f} | {med['busy']:.1f} ({busy[0]:.1f}-"
                f"{busy[-1]:.1f}) | {med['idle_lt_2us']:.0f} / {med['idle_2_20us']:.0f} / "
                f"{med['idle_ge_20us']:.0f} | {med['launches']:.0f} | {med['gemm']:.1f} | "
                f"{med['fused']:.1f} | "
                f"{med['nccl']:.1f} | {med['other']:.1f} |"
            )
            print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        model=args.model,
        tp=args.tp,
        layers=args.layers,
        iters=args.iters,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        devices=[str(d) for d in jax.devices()[: args.tp]],
    )
    (args.out / "decode_tp_profile.json").write_text(
        json.dumps(dict(meta=meta, rows=rows), indent=1)
    )
    head = (
        "| batch | mode | wall ms | busy us (min-max) | idle us, gaps < 2 / 2-20 / >= 20 us | "
        "launches | gemm | fused | nccl | other |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    (args.out / "decode_tp_profile.md").write_text(
        f"{args.model} x{args.layers} layers, TP {args.tp}, us per step per GPU (median over "
        f"GPUs)\n\n" + head + "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
