"""Probe (GPU, one device): does one small kernel resident beside a GEMM chain stretch it?

The copy-engine call (``algo="ce"``) leaves the GEMMs of the other half their SMs except for a
one-warp wait kernel and the reduce kernel. At 16384 tokens its GEMMs still ran 4.7% longer
(``benchmarks/results/2026-11-28-h200x2``). One explanation: a cuBLAS GEMM runs one CTA per SM
over a fixed tile schedule and needs a whole SM's registers, so a kernel holding even one warp
on an SM keeps that SM's CTA waiting, and the GEMM ends as late as that CTA. This measures it:
a chain of a layer's MLP GEMMs (Llama-3.3-70B at TP 2: ``M x 8192 @ 8192 x 28672`` then
``M x 14336 @ 14336 x 8192``, bf16) on one stream, alone and with a one-thread spin kernel
(``torch.cuda._sleep``) of ``--sleep-us`` launched on another stream just before it. Per (M,
sleep): the chain's median ms (CUDA events, ``--reps`` after warm-up) and its excess over the
chain alone against the sleep's own length. Writes ``resident_kernel.json`` in ``--out``.

    python3 -P benchmarks/probes/resident_kernel_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def cycles_per_us(torch: Any) -> float:
    """SM clock cycles per microsecond, timed: ``torch.cuda._sleep`` spins for cycles."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def chain_ms(torch: Any, m: int, sleep_cycles: int, reps: int, layers: int) -> list[float]:
    """Each rep's ms of ``layers`` MLP GEMM pairs of ``m`` rows, a sleep kernel beside it."""
    main, side = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.randn(m, 8192, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(8192, 28672, device="cuda", dtype=torch.bfloat16) * 0.01
    down = torch.randn(14336, 8192, device="cuda", dtype=torch.bfloat16) * 0.01
    times = []
    for rep in range(reps + 3):
        ready = torch.cuda.Event()
        ready.record(main)
        side.wait_event(ready)  # the sleep starts with the chain, not before
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
        with torch.cuda.stream(main):
            start.record()
            h = x
            for _ in range(layers):
                h = (h @ up)[:, :14336] @ down
            end.record()
        end.synchronize()
        torch.cuda.synchronize()
        if rep >= 3:
            times.append(start.elapsed_time(end))
    return times


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--sleep-us", type=float, nargs="+", default=[0, 50, 200, 1000])
    p.add_argument("--layers", type=int, default=4, help="GEMM pairs in the chain")
    p.add_argument("--reps", type=int, default=15)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (PyTorch with CUDA)")
    per_us = cycles_per_us(torch)
    rows: list[dict[str, Any]] = []
    for m in a.rows:
        alone = statistics.median(chain_ms(torch, m, 0, a.reps, a.layers))
        for us in a.sleep_us:
            ms = chain_ms(torch, m, int(us * per_us), a.reps, a.layers)
            med = statistics.median(ms)
            rows.append(
                {
                    "rows": m,
                    "sleep_us": us,
                    "chain_ms": med,
                    "chain_alone_ms": alone,
                    "excess_us": (med - alone) * 1e3,
                    "spread_ms": [min(ms), max(ms)],
                }
            )
            print(
                f"M {m}: sleep {us:.0f} us beside: chain {med:.3f} ms (alone {alone:.3f}), "
                f"excess {(med - alone) * 1e3:.0f} us"
            )
    a.out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "cycles_per_us": per_us, "rows": rows}
    (a.out / "resident_kernel.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
