"""The cases of ``attention_bench.py`` and their timing: the case list, random inputs, each
implementation's step and its chained, compiled call, ``run_case`` (compile, check against
``xla``, time) and the profiled device time per call."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.kernel._util import ceil_div


def _sibling(name: str) -> Any:
    """``benchmarks/<name>.py`` (``benchmarking.sibling_module``)."""
    return bm.sibling_module(__file__, name)


def _roofline() -> Any:
    """``benchmarks/roofline.py``."""
    return _sibling("roofline")


Case = _roofline().Case
moved_bytes = _roofline().moved_bytes
attention_flops = _roofline().attention_flops


# ----------------------------------------------------------------------------------- cases ---


def cases(a: argparse.Namespace) -> list[Case]:
    out = (
        []
        if a.no_decode
        else [Case("decode", batch=b, context=c) for b in a.batch for c in a.context]
    )
    if not a.no_prefill:
        out += [Case("prefill", chunk=c, prefix=p) for c in a.chunks for p in a.prefixes]
    return out


# ---------------------------------------------------------------------------------- inputs ---


def make_inputs(case: Case, a: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Random queries and caches, a random permutation of blocks as the block tables."""
    import jax
    import jax.numpy as jnp

    bs, per_chunk = a.block_size, a.key_chunk // a.block_size
    per_request = ceil_div(case.keys, bs)
    width = ceil_div(per_request, per_chunk) * per_chunk
    rng = np.random.default_rng(seed)
    perm = rng.permutation(case.requests * per_request).astype(np.int32)
    tables = np.zeros((case.requests, width), np.int32)
    tables[:, :per_request] = perm.reshape(case.requests, per_request)
    if case.kind == "decode":
        positions = np.full(case.batch, case.context - 1, np.int32)
    else:
        positions = np.arange(case.prefix, case.prefix + case.chunk, dtype=np.int32)
        tables = np.repeat(tables, case.chunk // a.tile, axis=0)
    dtype = bm.DTYPES[a.dtype]
    shape = (case.requests * per_request, bs, a.kv_heads, a.head_dim)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (case.rows, a.heads, a.head_dim), dtype)
    return {
        "q": q,
        "k": jax.jit(lambda: jax.random.normal(kk, shape, dtype))(),
        "v": jax.jit(lambda: jax.random.normal(kv, shape, dtype))(),
        "keys": (kk, kv, shape, dtype),
        "tables": jnp.asarray(tables),
        "positions": jnp.asarray(positions),
        "tile": 1 if case.kind == "decode" else a.tile,
    }


def unavailable(impl: str, case: Case, a: argparse.Namespace, platform: str) -> str | None:
    """Why ``impl`` cannot run ``case`` here (None where it can)."""
    from jax_tokenweave.serving.attention import attention_kernel, cudnn_attention

    if impl in ("cuda", "cudnn"):
        why = attention_kernel.unavailable_reason(
            platform, bm.DTYPES[a.dtype], a.head_dim, a.heads // a.kv_heads
        )
        if why is None and impl == "cudnn":
            if case.kind == "decode":
                return "cudnn runs the prompt tiles only (decode rows: cuda)"
            why = cudnn_attention.unavailable_reason(platform, bm.DTYPES[a.dtype], a.head_dim)
        return why
    if impl == "pallas":
        if case.kind != "decode":
            return "JAX's Pallas paged attention is a decode kernel"
        if platform != "gpu" and not a.pallas_interpret:
            return f"JAX's Pallas GPU paged attention needs a GPU (Triton), not {platform!r}"
    return None


def chained(step: Any, inner: int, donate: bool) -> Any:
    """``f(q, k, v, tables, positions) -> (first out, last out, k, v)``: ``inner`` calls of
    ``step`` (``-> out, k, v``), each call's output the next one's queries, unrolled."""
    import jax

    def f(q: Any, k: Any, v: Any, tables: Any, positions: Any) -> Any:
        first, k, v = step(q, k, v, tables, positions)
        out = first
        if inner > 1:
            out, k, v = jax.lax.fori_loop(
                0,
                inner - 1,
                lambda _, c: step(c[0], c[1], c[2], tables, positions),
                (first, k, v),
                unroll=True,
            )
        return first, out, k, v

    return jax.jit(f, donate_argnums=(1, 2) if donate else ())


def step_fn(impl: str, a: argparse.Namespace, tile: int) -> Any:
    """One call of ``impl`` as ``step(q, k, v, tables, positions) -> (out, k, v)``. Decode
    rows run as in the engine's decode-only step (every row live: the ``tight`` grid)."""
    from jax_tokenweave.serving.attention.paged_attention import paged_attention

    if impl != "pallas":
        return lambda q, k, v, t, p: paged_attention(
            q, k, v, t, p, tile=tile, key_chunk=a.key_chunk, implementation=impl, tight=tile == 1
        )
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas

    pages = None

    def step(q: Any, k: Any, v: Any, tables: Any, positions: Any) -> Any:
        nonlocal pages
        pages = tables.shape[1]
        splits = next(s for s in (16, 8, 4, 2, 1) if pages % s == 0)
        out = pallas.paged_attention(
            q,
            k,
            v,
            tables,
            positions + 1,
            k_splits=splits,
            pages_per_compute_block=min(8, pages // splits),
            interpret=a.pallas_interpret,
        )
        return out, k, v

    return step


def prepare(impl: str, a: argparse.Namespace, inp: dict[str, Any], state: dict[str, Any]) -> Any:
    """A zero-argument call of ``impl``'s chained function on the case's inputs (-> first out,
    last out). ``xla`` and ``cuda`` share ``state``'s caches (donated, handed on); ``pallas``
    gets its own copy in its layout ``[KVH, NB, BS, D]`` and queries times the scale."""
    import jax
    import jax.numpy as jnp

    pallas = impl == "pallas"
    f = chained(step_fn(impl, a, inp["tile"]), a.inner, donate=not pallas)
    q = inp["q"]
    if pallas:
        kk, kv, shape, dtype = inp["keys"]
        layout = jax.jit(
            lambda key: jnp.transpose(jax.random.normal(key, shape, dtype), (2, 0, 1, 3))
        )
        state = {"k": layout(kk), "v": layout(kv)}
        q = q * jnp.asarray(1.0 / math.sqrt(a.head_dim), q.dtype)
    compiled = f.lower(q, state["k"], state["v"], inp["tables"], inp["positions"]).compile()

    def call() -> Any:
        first, out, k, v = compiled(q, state["k"], state["v"], inp["tables"], inp["positions"])
        if not pallas:
            state["k"], state["v"] = k, v
        return first, out

    return call


def run_case(
    case: Case, a: argparse.Namespace, platform: str, seed: int, impls: Sequence[str]
) -> list[dict[str, Any]]:
    """Compile, check against ``xla`` and time every implementation on one case."""
    import jax.numpy as jnp

    from jax_tokenweave.harness import timing
    from jax_tokenweave.harness.modes import one_line

    rf = _roofline()
    inp = make_inputs(case, a, seed)
    itemsize = jnp.dtype(bm.DTYPES[a.dtype]).itemsize
    base = {
        **dataclasses.asdict(case),
        "bytes": moved_bytes(case, a.heads, a.kv_heads, a.head_dim, itemsize),
        "flops": attention_flops(case, a.heads, a.head_dim),
    }
    info: dict[str, dict[str, Any]] = {}
    fns: dict[str, Any] = {}
    state = {"k": inp["k"], "v": inp["v"]}  # our layout, donated from call to call
    firsts: dict[str, Any] = {}
    for impl in dict.fromkeys(["xla", *impls]):
        why = unavailable(impl, case, a, platform)
        if why is not None:
            info[impl] = {"status": "skipped", "reason": why}
            continue
        try:
            start = time.perf_counter()
            fns[impl] = prepare(impl, a, inp, state)
            firsts[impl] = np.asarray(fns[impl]()[0], np.float32)  # compiles
            info[impl] = {"status": "ok", "compile_s": time.perf_counter() - start}
        except Exception as err:  # a refusal must not end the sweep
            info[impl] = {"status": "error", "reason": one_line(err)}
            fns.pop(impl, None)
            traceback.print_exc(limit=2)
    ref = firsts.get("xla")
    for impl, first in firsts.items():
        if impl != "xla" and ref is not None:
            err = timing.rel_error(first, ref)
            info[impl].update(rel_err=err, flagged=not err <= a.tolerance)
            if not err <= a.tolerance:
                print(
                    f"MISMATCH {impl} {case}: relative error {err:.3g} > {a.tolerance}",
                    file=sys.stderr,
                )
    timed = {impl: fns[impl] for impl in impls if impl in fns}
    if timed:
        for impl, stats in timing.benchmark(timed, warmup=a.warmup, iters=a.iters).items():
            us = stats.median_ms * 1e3 / a.inner
            info[impl].update(
                median_us=us,
                p10_us=stats.p10_ms * 1e3 / a.inner,
                p90_us=stats.p90_ms * 1e3 / a.inner,
                gb_s=base["bytes"] / (us * 1e-6) / rf.GB,
                tflop_s=base["flops"] / (us * 1e-6) / 1e12,
            )
            if a.profile:
                info[impl].update(_device_time(timed[impl], a, base["bytes"]))
    return [{**base, "impl": impl, **info[impl]} for impl in impls]


def _device_time(fn: Any, a: argparse.Namespace, moved: int) -> dict[str, Any]:
    """``fn``'s profiled device time per call (``step_profile.profile_steps`` over
    ``--profile`` dispatches of ``--inner`` calls): ``device_us``, ``device_gb_s``,
    ``launches``, ``kernels``; ``{"profile": reason}`` where it cannot profile."""
    import jax

    prof = _sibling("step_profile").profile_steps(
        lambda: jax.block_until_ready(fn()), a.profile, top=4
    )
    if prof["status"] != "ok":
        return {"profile": prof["reason"]}
    us = prof["busy_ms"] * 1e3 / a.inner
    return {
        "device_us": us,
        "device_gb_s": moved / (us * 1e-6) / _roofline().GB,
        "launches": prof["launches_per_step"] / a.inner,
        "kernels": [
            {"name": k["name"], "us": k["ms_per_step"] * 1e3 / a.inner} for k in prof["kernels"]
        ],
    }
