"""Paged attention of one layer, one rank: decode and chunked prefill, implementations side by side.

Implementations (``--impls``), all on the same inputs in one run:

- ``xla``: ``serving.attention.paged_attention``'s pure-JAX key loop (the reference);
- ``cuda``: the project's CUDA kernels (``serving.attention.attention_kernel``), where they can run;
- ``cudnn``: prompt tiles on cuDNN flash attention (``serving.attention.cudnn_attention``; prefill
only);
- ``pallas``: JAX's ``jax.experimental.pallas.ops.gpu.paged_attention`` (decode only, GPUs only;
  its cache layout ``[KVH, NB, BS, D]`` and pre-scaled queries are built before the clock
  starts; it holds a second copy of the cache in that layout).

Decode: ``--batch`` requests of one query row each at position ``context - 1`` (``--context``
keys each). Prefill: one request's chunk of ``--chunks`` rows (tiles of ``--tile`` rows) over a
cached prefix of ``--prefixes`` positions (the chunk's own K/V are in the cache too, as in a
serving step). Block tables are a random permutation of the cache's blocks; queries and the
cache are fresh random normals (``--seed``). Each function runs ``--inner`` chained calls per
dispatch (each call's output is the next one's queries; the caches are donated and handed on),
timed by ``jax_tokenweave.harness.timing.benchmark`` (warm-up, interleaved timed dispatches,
median); reported per call. Every implementation's first output is compared with ``xla``'s (relative
Frobenius error; above ``--tolerance`` it is flagged).

Per case: time, bytes moved (K and V read once per request and kv head, plus q and out), GB/s
and its share of the bandwidth of a device-to-device copy measured in the same run (bytes read
+ written; ``--copy-gb``), and for prefill the FLOPs of the visible (causal) query-key pairs
(``4 * D`` per pair and query head) and TFLOP/s. Writes ``attention.json``, ``attention.md`` and
``attention.png`` (decode GB/s vs context, a panel per batch) into ``--out``. With no GPU it
runs tiny shapes (a minute at most); ``--quick`` runs a small subset. This module holds the
command line and the run; the cases and their timing are in ``attention_cases.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.kernel._util import ceil_div

IMPLS = ("xla", "cuda", "cudnn", "pallas")
# (GPU default, GPU --quick, CPU default, CPU --quick) per sweep option.
SWEEPS: dict[str, tuple[list[int], ...]] = {
    "batch": ([1, 16, 64, 256], [1, 64], [1, 4], [2]),
    "context": ([512, 1024, 4096, 8192, 32768], [1024, 8192], [64, 256], [64]),
    "chunks": ([512, 2048, 8192], [2048], [32, 64], [32]),
    "prefixes": ([0, 8192, 24576], [0, 8192], [0, 96], [48]),
}
# Per-rank shapes: Llama-3-8B at TP 1 on GPUs, tiny ones on CPUs.
SHAPES = {
    "gpu": dict(heads=32, kv_heads=8, head_dim=128, block_size=16, tile=128, key_chunk=512),
    "cpu": dict(heads=8, kv_heads=2, head_dim=32, block_size=16, tile=16, key_chunk=64),
}


def _sibling(name: str) -> Any:
    """``benchmarks/<name>.py`` (``benchmarking.sibling_module``)."""
    return bm.sibling_module(__file__, name)


def _roofline() -> Any:
    """``benchmarks/roofline.py``."""
    return _sibling("roofline")


def _attention_cases() -> Any:
    """``benchmarks/attention_cases.py``: the cases, their inputs and timing."""
    return _sibling("attention_cases")


def _ints(text: str) -> list[int]:
    return [bm.nonnegative_int(t) for t in text.replace(",", " ").split()]


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; see ``--help``."""
    p = argparse.ArgumentParser(
        prog="attention_bench.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=bm.HelpFormatter,
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="folder for attention.json, attention.md and attention.png",
    )
    p.add_argument(
        "--impls",
        nargs="+",
        choices=IMPLS,
        default=list(IMPLS),
        help="implementations to time (xla is always run: it is the reference)",
    )
    for name, help_ in (
        ("batch", "decode: requests"),
        ("context", "decode: keys per request"),
        ("chunks", "prefill: rows of the chunk"),
        ("prefixes", "prefill: cached positions before the chunk"),
    ):
        p.add_argument(
            "--" + name,
            type=_ints,
            nargs="+",
            action=bm.Flatten,
            help=f"{help_} (default: {' '.join(map(str, SWEEPS[name][0]))} on GPUs, "
            f"{' '.join(map(str, SWEEPS[name][2]))} on CPUs)",
        )
    p.add_argument("--quick", action="store_true", help="a small subset of the default sweep")
    p.add_argument("--no-decode", action="store_true", help="skip the decode cases")
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill cases")
    for name in SHAPES["gpu"]:
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=bm.positive_int,
            help=f"(default: {SHAPES['gpu'][name]} on GPUs, {SHAPES['cpu'][name]} on CPUs)",
        )
    bm.add_run_options(p, warmup=2, iters=10, unit="case and implementation")
    p.add_argument(
        "--inner",
        type=bm.positive_int,
        help="chained calls per timed dispatch (default: 10 on GPUs, 1 on CPUs)",
    )
    p.add_argument(
        "--tolerance",
        type=bm.positive_float,
        help="relative error vs xla above which a result is flagged (default: 2e-2 "
        "in bfloat16/float16, 1e-4 in float32)",
    )
    p.add_argument(
        "--max-cache-gb",
        type=bm.positive_float,
        default=40.0,
        help="skip cases whose cache (K + V, our layout) exceeds this many GB",
    )
    p.add_argument(
        "--copy-gb",
        type=bm.positive_float,
        help="bytes of the bandwidth copy, GB (default: 2 on GPUs, 0.1 on CPUs)",
    )
    p.add_argument(
        "--profile",
        type=bm.nonnegative_int,
        default=0,
        metavar="N",
        help="also profile N dispatches per case and implementation (PyTorch's CUDA profiler): "
        "device time per call (the union of its kernels), the launches per call",
    )
    p.add_argument(
        "--pallas-interpret",
        action="store_true",
        help="run the Pallas kernel in interpret mode (slow; lets a CPU check the "
        "layout adaptation)",
    )
    bm.add_sweep_options(p, plot="attention.png")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the options (``parser.error`` before any work on bad ones)."""
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("batch", "context", "chunks"):
        if 0 in (getattr(args, name) or []):
            p.error(f"--{name}: values must be >= 1")
    if args.no_decode and args.no_prefill:
        p.error("--no-decode and --no-prefill leave nothing to run")
    if not args.no_plot and (hint := bm.matplotlib_missing()):
        p.error(f"the plot {hint} (or pass --no-plot)")
    return args


def resolve(args: argparse.Namespace, platform: str) -> argparse.Namespace:
    """``args`` with the platform's defaults filled in; ``ValueError`` on inconsistent shapes."""
    a = argparse.Namespace(**vars(args))
    gpu = platform == "gpu"
    pick = (0 if gpu else 2) + (1 if a.quick else 0)
    for name, options in SWEEPS.items():
        if getattr(a, name) is None:
            setattr(a, name, list(options[pick]))
    for name, value in SHAPES["gpu" if gpu else "cpu"].items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    a.inner = a.inner or (10 if gpu else 1)
    a.copy_gb = a.copy_gb or (2.0 if gpu else 0.1)
    a.tolerance = a.tolerance or (1e-4 if a.dtype == "float32" else 2e-2)
    if a.heads % a.kv_heads:
        raise ValueError(f"--heads {a.heads} is not a multiple of --kv-heads {a.kv_heads}")
    if a.key_chunk % a.block_size:
        raise ValueError(
            f"--key-chunk {a.key_chunk} is not a multiple of --block-size {a.block_size}"
        )
    if bad := [c for c in a.chunks if c % a.tile]:
        raise ValueError(f"--chunks {bad} are not multiples of --tile {a.tile}")
    return a


def run(a: argparse.Namespace, device: Any, platform: str, seed: int) -> dict[str, Any]:
    """The bandwidth, then every case; the report's ``bandwidth`` and ``records``."""
    import jax.numpy as jnp

    rf, ac = _roofline(), _attention_cases()
    bandwidth = rf.copy_bandwidth(
        device, int(a.copy_gb * rf.GB), warmup=a.warmup, iters=max(a.iters, 5)
    )
    print(
        f"copy bandwidth: {bandwidth['gb_s']:.0f} GB/s (read + write of "
        f"{bandwidth['bytes'] / rf.GB:.2f} GB)",
        file=sys.stderr,
    )
    itemsize = jnp.dtype(bm.DTYPES[a.dtype]).itemsize
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    todo = ac.cases(a)
    for i, case in enumerate(tqdm(todo, desc="attention_bench")):
        keys = case.requests * ceil_div(case.keys, a.block_size) * a.block_size
        cache_gb = rf.kv_bytes(keys, a.kv_heads, a.head_dim, itemsize) / rf.GB
        reason = None
        if cache_gb > a.max_cache_gb:
            reason = f"cache of {cache_gb:.1f} GB exceeds --max-cache-gb {a.max_cache_gb:g}"
        elif a.time_budget is not None and time.perf_counter() - start > a.time_budget:
            reason = "time budget exhausted"
        if reason:
            records += [
                {**dataclasses.asdict(case), "impl": impl, "status": "skipped", "reason": reason}
                for impl in a.impls
            ]
            continue
        records += ac.run_case(case, a, platform, seed + i, a.impls)
        for r in records[-len(a.impls) :]:
            r["pct_bw"] = 100 * r["gb_s"] / bandwidth["gb_s"] if "gb_s" in r else None
            if "device_gb_s" in r:
                r["device_pct_bw"] = 100 * r["device_gb_s"] / bandwidth["gb_s"]
    return {"bandwidth": bandwidth, "records": records}


# ---------------------------------------------------------------------------------- output ---


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep and write the outputs; 1 where a result was flagged, else 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    platform, devices = bm.start_devices(1)
    try:
        a = resolve(args, platform)
    except ValueError as err:
        print(f"attention_bench.py: error: {err}", file=sys.stderr)
        return 2
    seed = a.seed if a.seed is not None else bm.resolve_seed()
    report = run(a, devices[0], platform, seed)
    report["environment"] = bm.environment(devices[:1], ["benchmarks/attention_bench.py", *argv])
    report["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    report["config"]["seed"] = seed
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "attention.json").write_text(json.dumps(report, indent=2) + "\n")
    (a.out / "attention.md").write_text(_sibling("attention_report").to_markdown(report) + "\n")
    if not a.no_plot:
        _sibling("attention_report").write_plot(report, a.out / "attention.png")
    print(_sibling("attention_report").to_markdown(report))
    if platform == "cpu":
        print("note: CPU timings; run on a GPU to measure the kernels.")
    return 1 if any(r.get("flagged") for r in report["records"]) else 0


if __name__ == "__main__":
    sys.exit(main())
