"""Where an engine step's wall time goes: device kernels vs host gaps, from PyTorch's profiler.

PyTorch's CUDA profiler (CUPTI) records every kernel of the process, JAX's included.
:func:`profile_steps` runs ``step()`` ``n`` times under it and returns per step: the wall time,
the device-busy time (the union of the kernels' intervals, so overlapping kernels count once),
the host gap (wall - busy: the GPU idle while Python schedules, packs, dispatches and reads
results back), the kernels that took the most device time, and the host's own profile of the
same steps (``cProfile``, the functions with the most time of their own). Without PyTorch or a
CUDA GPU it returns a record that says so. With steps pipelined (the engine's async scheduling),
the first profiled step starts on an idle GPU (the profiler's start outlasts the step in flight):
profile 20 steps or more before reading the host gap as the steady state's. Per GPU (several
in one process): :func:`record_kernels`, :func:`per_device` (busy time, launches, time by kernel
class) and :func:`busy_ms` (the median over GPUs, ``e2e_bench.py --device-time``).
"""

from __future__ import annotations

import collections
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from jax_tokenweave.harness import timing

FUSED = ("OneShot", "LocalRows", "TwoShot", "Direct", "Fused", "CeWait", "CeReduce", "CeFinish")
"""Name parts of this library's fused collective kernels (the copy-engine call's included)."""
GEMM = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "triton_dot")
"""Name parts (lower case) of matrix-multiply kernels."""


class Kernel(NamedTuple):
    """One kernel launch the profiler saw (times in us)."""

    device: int
    start: float
    end: float
    name: str
    device_us: float


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (any unit)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def kernel_class(name: str) -> str:
    """``fused`` (this library's collective), ``nccl``, ``gemm``, ``copy`` (memcpy and memset,
    copy engines: the ``ce`` call's transfers) or ``other``."""
    if "tokenweave" in name and any(k in name for k in FUSED):
        return "fused"
    if name.startswith(("Memcpy", "Memset")):
        return "copy"
    if "nccl" in name.lower():
        return "nccl"
    return "gemm" if any(k in name.lower() for k in GEMM) else "other"


def unavailable_reason() -> str | None:
    """None where PyTorch's CUDA profiler can run here; else why not."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed (its CUDA profiler gives the device time)"
    if not torch.cuda.is_available():
        return "no CUDA GPU for PyTorch's profiler"
    return None


def record_kernels(
    run: Callable[[], Any], iters: int, warm: int = 3, ahead: int = 1
) -> tuple[float, list[Kernel]]:
    """``warm`` runs of ``run`` (each waited for), then ``iters`` x ``ahead`` under the profiler
    (``ahead`` runs dispatched back to back, then waited for): the host ms per run and every
    kernel launched in them."""
    import jax
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    for _ in range(warm):
        jax.block_until_ready(run())
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        wall_ms = statistics.mean(timing.time_once(run, ahead) for _ in range(iters))
        torch.cuda.synchronize()
    kernels = [
        Kernel(e.device_index, e.time_range.start, e.time_range.end, e.name, e.device_time_total)
        for e in prof.events()
        if "CUDA" in str(getattr(e, "device_type", ""))
    ]
    return wall_ms, kernels


def per_device(kernels: list[Kernel], iters: int) -> dict[int, dict[str, float]]:
    """Per device, per run: ``busy`` us (kernels that overlap count once), ``launches``, and the
    summed device us of each :func:`kernel_class`."""
    by_dev: dict[int, list[Kernel]] = collections.defaultdict(list)
    for k in kernels:
        by_dev[k.device].append(k)
    out: dict[int, dict[str, float]] = {}
    for dev, ks in sorted(by_dev.items()):
        row = {"busy": busy_us([(k.start, k.end) for k in ks]) / iters, "launches": len(ks) / iters}
        for k in ks:
            cls = kernel_class(k.name)
            row[cls] = row.get(cls, 0.0) + k.device_us / iters
        out[dev] = row
    return out


def busy_ms(run: Callable[[], Any], iters: int, ahead: int = 1) -> dict[str, Any]:
    """Device-busy ms per run of ``run`` (:func:`record_kernels`): ``median`` over GPUs and
    their ``range`` [min, max], and ``classes``: per :func:`kernel_class` the summed device ms
    (median over GPUs); ``reason`` instead where the profiler cannot run here."""
    if (why := unavailable_reason()) is not None:
        return {"reason": why}
    _, kernels = record_kernels(run, iters, ahead=ahead)
    rows = per_device(kernels, iters * ahead).values()
    busy = sorted(d["busy"] / 1e3 for d in rows)
    if not busy:
        return {"reason": "the profiler saw no kernel"}
    names = sorted({k for d in rows for k in d} - {"busy", "launches"})
    classes = {c: statistics.median(d.get(c, 0.0) / 1e3 for d in rows) for c in names}
    return {"median": statistics.median(busy), "range": [busy[0], busy[-1]], "classes": classes}


def idle_gaps(spans: list[tuple[float, float, str]], top: int = 6) -> dict[str, Any]:
    """Idle stretches between kernels (``(start, end, name)``, µs): the total in each size
    class (``< 2 µs``, ``2-20 µs``, ``>= 20 µs``) and the ``top`` longest, with the kernels on
    either side (``before``, ``after``)."""
    classes = {"lt_2us": 0.0, "2_20us": 0.0, "ge_20us": 0.0}
    found: list[dict[str, Any]] = []
    end: float | None = None  # the latest end so far, and its kernel
    last = ""
    for a, b, name in sorted(spans):
        if end is not None and a > end:
            gap = a - end
            classes["lt_2us" if gap < 2 else "2_20us" if gap < 20 else "ge_20us"] += gap
            found.append({"us": gap, "before": last, "after": name})
        if end is None or b > end:
            end, last = b, name
    found.sort(key=lambda g: -g["us"])
    return {"classes_us": classes, "longest": found[:top]}


def _spread(values: list[float]) -> list[float]:
    """Min, median and max of ``values``."""
    ordered = sorted(values)
    return [ordered[0], ordered[len(ordered) // 2], ordered[-1]]


def profile_steps(
    step: Callable[[], Any], n: int, top: int = 24, host_profile: bool = True
) -> dict[str, Any]:
    """Profile ``n`` calls of ``step`` (each must wait for its results, as ``engine.step``
    does). Returns ``{"status", "wall_ms", "busy_ms", "gap_ms", "launches_per_step",
    "kernels", "idle_gaps", "host_profile"}``, times per step; each kernel with its launches
    per step and the min / median / max device time of one launch; the idle stretches between
    kernels (:func:`idle_gaps`, classes per step). ``host_profile=False``: no cProfile (it
    slows the host, so the GPU may idle more)."""
    if (why := unavailable_reason()) is not None:
        return {"status": "skipped", "reason": why}
    from torch.profiler import ProfilerActivity, profile

    host = cProfile.Profile() if host_profile else None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        if host is not None:
            host.enable()
        for _ in range(n):
            step()
        if host is not None:
            host.disable()
        wall = time.perf_counter() - start
    text = io.StringIO()
    if host is not None:
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(top)
    kernels = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    launches: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        launches[e.name[:80]].append(e.device_time_total)
    by_name = {k: sum(v) for k, v in launches.items()}
    busy = busy_us(intervals) / 1e3 / n
    gaps = idle_gaps([(e.time_range.start, e.time_range.end, e.name[:60]) for e in kernels])
    gaps["classes_us"] = {k: v / n for k, v in gaps["classes_us"].items()}
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "status": "ok",
        "steps": n,
        "wall_ms": wall * 1e3 / n,
        "busy_ms": busy,
        "gap_ms": wall * 1e3 / n - busy,
        "kernel_ms": sum(by_name.values()) / 1e3 / n,
        "launches_per_step": len(kernels) / n,
        "kernels": [
            {
                "name": k,
                "ms_per_step": v / 1e3 / n,
                "calls_per_step": len(launches[k]) / n,
                "us_per_launch_min_p50_max": _spread(launches[k]),
            }
            for k, v in ranked
        ],
        "idle_gaps": gaps,
        "host_profile": text.getvalue(),
    }
