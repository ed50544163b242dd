"""Probe (GPUs): where a TP decode step's time goes on each GPU, mode by mode.

The decode batches of ``e2e_bench.py`` (one token per request, Llama-3.3-70B shapes,
``--layers`` layers) in ``--modes`` (default baseline, nocomm, weave-ffi, weave-ffi-sync). Per
mode and batch, ``--iters`` x ``--ahead`` steps run under PyTorch's profiler after three warm
ones (``--ahead`` dispatched back to back, then waited for, as a server does); per GPU:
busy time (the union of its kernels), idle time between kernels by the gap's length (short
gaps are launch latency, long ones the host between steps), kernels launched, device time by
kernel class (``gemm``, ``fused`` collective, ``nccl``, ``other``), and the fused call's median
time as a step's first call and as the others (the first absorbs the GPUs' skew at a step's
start). Columns show the median over GPUs (busy time also its min and max); wall is the host's.
Run: ``python3 -P benchmarks/probes/decode_tp_profile_probe.py --tp 4 --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import jax

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.harness.modes import Mode, compile_forward, make_plan

_step_profile = bm.sibling_module(
    str(Path(__file__).resolve().parents[1] / "e2e_bench.py"), "step_profile"
)
MODES = {
    m.name: m
    for m in (Mode("baseline"), Mode("nocomm"), Mode("weave", "ffi"), Mode("weave", "ffi-sync"))
}


def per_gpu(run: Any, iters: int, ahead: int = 1) -> tuple[float, dict[int, dict[str, float]]]:
    """Host ms per step and, per device: ``busy``, ``launches``, each kernel class's us and
    ``idle_<gap class>`` (between kernels, by the gap's length) per step."""
    wall_ms, kernels = _step_profile.record_kernels(run, iters, ahead=ahead)
    runs = iters * ahead
    out = _step_profile.per_device(kernels, runs)
    for dev, row in out.items():
        spans = [(k.start, k.end, k.name[:60]) for k in kernels if k.device == dev]
        for size, us in _step_profile.idle_gaps(spans)["classes_us"].items():
            row[f"idle_{size}"] = us / runs
        fused = sorted(
            (k.start, k.device_us)
            for k in kernels
            if k.device == dev and _step_profile.kernel_class(k.name) == "fused"
        )
        per_step = len(fused) // runs
        if per_step > 1 and len(fused) == per_step * runs:  # each step's first call apart
            steps = [fused[i * per_step : (i + 1) * per_step] for i in range(runs)]
            row["fused_first_us"] = statistics.median(s[0][1] for s in steps)
            row["fused_rest_us"] = statistics.median(us for s in steps for _, us in s[1:])
    return wall_ms, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-70b", help=bm.config_names_help())
    ap.add_argument("--tp", type=int, default=len(jax.devices()), help="tensor-parallel degree")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="decode rows")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument(
        "--iters", type=bm.positive_int, default=20, help="profiled groups of steps per point"
    )
    ap.add_argument(
        "--ahead",
        type=bm.positive_int,
        default=1,
        help="steps dispatched back to back per group (a server)",
    )
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
            wall, gpus = per_gpu(run, args.iters, args.ahead)
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
            firsts = [g.get("fused_first_us") for _, g in sorted(gpus.items())]
            if all(f is not None for f in firsts):
                rests = [g["fused_rest_us"] for _, g in sorted(gpus.items())]
                lines[-1] += (
                    f" first call of a step {' / '.join(f'{f:.1f}' for f in firsts)} us, the"
                    f" others {' / '.join(f'{r:.1f}' for r in rests)} (per GPU)"
                )
            print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        model=args.model,
        tp=args.tp,
        layers=args.layers,
        iters=args.iters,
        ahead=args.ahead,
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
