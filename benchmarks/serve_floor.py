"""The floor of a served workload (``serve_bench.py``): the least time one GPU of the mesh needs,
running one kernel at a time as the engines here (and vLLM's) do, for the work of a run.

Every step reads each GEMM's weights and does its FLOPs, so the GEMMs of all steps take at least
the slower of all their FLOPs (prompt rows less prefix-cache hits, one LM-head row per prompt,
every generated row) at the matmul rate and ``steps`` reads of the weights at the copy
bandwidth; then every generated token reads the K/V of its context. Left out (so it stays a
floor): attention FLOPs, norms, communication, preemptions' recompute. The KV policy changes only
``steps`` and the hits: what it can gain is bounded by this floor. MoE configs: None.

CLI, for a ``serve.json`` written before serve_bench measured the rates itself::

    python benchmarks/serve_floor.py serve.json --tflop-s 790 --gb-s 4200
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jax_tokenweave.harness import benchmarking as bm

roofline = bm.sibling_module(__file__, "roofline")
serve_workloads = bm.sibling_module(__file__, "serve_workloads")


def gemm_params(config: Any, tp: int) -> int:
    """Weights of one rank's decoder-layer GEMMs, all layers (``roofline.projections``)."""
    return config.num_layers * sum(k * n for k, n in roofline.projections(config, tp))


def weight_bytes(config: Any, tp: int, itemsize: int) -> int:
    """Bytes a step reads of one rank's weights: the layers' GEMMs and the LM head (the
    embedding table is gathered, not read; norms are left out)."""
    return (gemm_params(config, tp) + config.hidden_size * config.vocab_size // tp) * itemsize


def context_positions(requests: Sequence[dict[str, Any]]) -> int:
    """Cached positions the generated tokens read, summed: a request of prompt ``p`` making
    ``n`` tokens reads ``p, p + 1, .., p + n - 1``."""
    total = 0
    for r in requests:
        p, n = len(r["prompt"]), r.get("output_len", r["max_tokens"])
        total += n * p + n * (n - 1) // 2
    return total


def run_floor(
    config: Any,
    tp: int,
    itemsize: int,
    requests: Sequence[dict[str, Any]],
    run: dict[str, Any],
    tflop_s: float,
    gb_s: float,
) -> dict[str, float] | None:
    """The floor (module docstring) of ``run`` (a ``serve_bench`` run: its ``prompt_tokens``,
    ``output_tokens``, ``prefix_cache_hits``, ``steps``, ``seconds``) of ``requests``, at
    ``tflop_s`` (1e12 FLOP/s) and ``gb_s`` (1e9 B/s); its parts in seconds and
    ``measured_over_floor``. None for experts."""
    if config.num_experts:
        return None
    rows = run["prompt_tokens"] - run["prefix_cache_hits"] + run["output_tokens"]
    head = config.hidden_size * config.vocab_size // tp
    flops = 2 * (gemm_params(config, tp) * rows + head * (len(requests) + run["output_tokens"]))
    gemm_flops_s = flops / (tflop_s * 1e12)
    gemm_bytes_s = run["steps"] * weight_bytes(config, tp, itemsize) / (gb_s * roofline.GB)
    kv = roofline.kv_bytes(
        context_positions(requests),
        config.num_kv_heads // tp,
        config.head_dim,
        itemsize,
        config.num_layers,
    )
    kv_s = kv / (gb_s * roofline.GB)
    floor = max(gemm_flops_s, gemm_bytes_s) + kv_s
    return {
        "gemm_flops_s": gemm_flops_s,
        "gemm_weight_reads_s": gemm_bytes_s,
        "kv_reads_s": kv_s,
        "floor_s": floor,
        "measured_over_floor": run["seconds"] / floor,
    }


def from_report(report: dict[str, Any], tflop_s: float, gb_s: float) -> dict[str, Any]:
    """Each run's floor of a ``serve.json`` report (its workloads regenerated from its config
    and seed): ``{workload: {schedule: {policy: floor}}}``."""
    import numpy as np

    args = argparse.Namespace(**report["config"])
    config = bm.load_config(report["model"], report["layers"])
    itemsize = np.dtype(bm.DTYPES[args.dtype]).itemsize
    out: dict[str, Any] = {}
    for workload, per in report["runs"].items():
        requests = serve_workloads.make_requests(workload, args, config.vocab_size)
        for schedule, by in per.items():
            for policy, run in by.items():
                floor = run_floor(config, report["tp"], itemsize, requests, run, tflop_s, gb_s)
                out.setdefault(workload, {}).setdefault(schedule, {})[policy] = floor
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print each run's floor of a ``serve.json`` at the rates given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="a serve_bench.py serve.json")
    parser.add_argument("--tflop-s", type=float, required=True, help="matmul rate, TFLOP/s")
    parser.add_argument("--gb-s", type=float, required=True, help="copy bandwidth, GB/s")
    a = parser.parse_args(argv)
    if a.tflop_s <= 0 or a.gb_s <= 0:
        parser.error("--tflop-s and --gb-s must be positive")
    report = json.loads(a.report.read_text())
    for workload, per in from_report(report, a.tflop_s, a.gb_s).items():
        for schedule, by in per.items():
            for policy, f in by.items():
                run = report["runs"][workload][schedule][policy]
                if f is None:
                    print(f"{workload} {schedule} {policy}: no floor (experts)")
                    continue
                print(
                    f"{workload} {schedule} {policy}: {run['seconds']:.1f} s, floor "
                    f"{f['floor_s']:.1f} s (GEMMs max({f['gemm_flops_s']:.1f} s FLOPs, "
                    f"{f['gemm_weight_reads_s']:.1f} s weight reads) + {f['kv_reads_s']:.1f} s "
                    f"K/V reads), {f['measured_over_floor']:.2f}x the floor"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
