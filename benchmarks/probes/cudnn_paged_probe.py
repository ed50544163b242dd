"""Probe (GPU): cuDNN's paged attention as XLA runs it, against the project's prompt kernel.

Checks which causal alignment cuDNN's mask has (top-left or bottom-right), that its
log-sum-exp is exact, what a row with no key gets, and that a cache of any block count works
through JAX's private entry; then times 8192 query rows after 0 / 8192 / 24576 cached keys per
tile size (64 .. 8192 rows per batch entry) against ``attention_kernel`` at 64-row tiles.
Llama-3-8B heads (32 / 8, D 128), bf16. Run: ``python3 -P benchmarks/probes/cudnn_paged_probe.py``
(the figures of benchmarks/results/2026-11-25-h200x1, "Probe").
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tokenweave.serving.attention import attention_kernel, cudnn_attention

HQ, KVH, D, BS = 32, 8, 128, 16
SCALE = D**-0.5
DT = jnp.bfloat16


def sdpa(q: Any, k: Any, v: Any, q_len: Any, kv_len: Any, causal: bool, table: Any = None) -> Any:
    """One cuDNN call (``cudnn_attention._sdpa``): out [B, T, Hq, D], lse [B, Hq, T]."""
    return cudnn_attention._sdpa(q, k, v, q_len, kv_len, causal=causal, scale=SCALE, table=table)


def reference(q: Any, kc: Any, vc: Any, table: np.ndarray, p0: int, ctx: int, align: str) -> Any:
    """Float32 attention of q [T, Hq, D] over keys 0..ctx-1: (out, lse [Hq, T])."""
    k = jnp.repeat(kc[table].reshape(-1, KVH, D)[:ctx].astype(jnp.float32), HQ // KVH, axis=1)
    v = jnp.repeat(vc[table].reshape(-1, KVH, D)[:ctx].astype(jnp.float32), HQ // KVH, axis=1)
    s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k) * SCALE
    rows = jnp.arange(q.shape[0]) + (p0 if align == "bottom-right" else 0)
    s = jnp.where(jnp.arange(ctx)[None, None, :] <= rows[None, :, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("hts,shd->thd", jnp.exp(s - lse[..., None]), v), lse


def rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def caches(nb: int, seed: int) -> tuple[Any, Any]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    shape = (nb, BS, KVH, D)
    return jax.random.normal(k1, shape, DT), jax.random.normal(k2, shape, DT)


def ms_per_call(f: Any, *args: Any, n: int = 10) -> float:
    """Median over three rounds of ``n`` back-to-back calls, after two warm calls."""
    for _ in range(2):
        jax.block_until_ready(f(*args))
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - start) / n * 1e3)
    return float(np.median(rounds))


def semantics() -> None:
    p0, t, nb = 256, 128, 97  # 97 blocks: not batch x table width
    ctx, w = p0 + t, (p0 + t) // BS
    kc, vc = caches(nb, 0)
    table = np.random.default_rng(0).permutation(nb)[:w].astype(np.int32)
    q = jax.random.normal(jax.random.PRNGKey(3), (t, HQ, D), DT)
    pages = jnp.asarray(table).reshape(1, 1, w, 1)
    lens = jnp.array([t], jnp.int32), jnp.array([ctx], jnp.int32)
    out, lse = jax.jit(lambda q, kc, vc, tb: sdpa(q[None], kc, vc, *lens, True, tb))(
        q, kc, vc, pages
    )
    for align in ("top-left", "bottom-right"):
        o_ref, l_ref = reference(q, kc, vc, table, p0, ctx, align)
        print(f"causal vs {align}: out {rel(out[0], o_ref):.2e}, lse {rel(lse[0], l_ref):.2e}")
    empty = jax.jit(
        lambda q, kc, vc, tb: sdpa(q[None], kc, vc, lens[0], jnp.zeros(1, jnp.int32), False, tb)
    )(q, kc, vc, pages)
    print(
        f"no key: out finite {bool(jnp.isfinite(empty[0].astype(jnp.float32)).all())}, "
        f"max |out| {float(jnp.abs(empty[0].astype(jnp.float32)).max())}"
    )


def timings() -> None:
    t, rng = 8192, np.random.default_rng(1)
    for p in (0, 8192, 24576):
        w = (p + t) // BS
        kc, vc = caches(w + 64, p)
        table = rng.permutation(w + 64)[:w].astype(np.int32)
        q = jax.random.normal(jax.random.PRNGKey(5), (t, HQ, D), DT)
        flop = 4 * HQ * D * (t * p + t * (t + 1) / 2)
        pos = jnp.asarray(p + np.arange(t), jnp.int32)
        kernel = jax.jit(
            lambda q, kc, vc, tb, pos: attention_kernel.paged_attention(
                q, kc, vc, tb, pos, tile=64, scale=SCALE
            )[0]
        )
        row = {
            "kernel, 64-row tiles": ms_per_call(kernel, q, kc, vc, np.tile(table, (128, 1)), pos)
        }
        for tile in (64, 128, 256, 1024, 8192):
            g = t // tile
            if p == 0 and tile == t:
                continue  # no prefix to attend to
            pages = jnp.asarray(np.tile(table, (g, 1))).reshape(g, 1, w, 1)
            kv_len = jnp.asarray(np.maximum(p + tile * np.arange(g), 16), jnp.int32)
            prefix = jax.jit(
                lambda qg, kc, vc, tb, kl: sdpa(
                    qg, kc, vc, jnp.full(qg.shape[:1], qg.shape[1], jnp.int32), kl, False, tb
                )
            )
            row[f"cuDNN prefix, {tile}-row tiles"] = ms_per_call(
                prefix, q.reshape(g, tile, HQ, D), kc, vc, pages, kv_len
            )
        for name, ms in row.items():
            print(f"prefix {p:5d}: {name:28s} {ms:8.3f} ms {flop / ms / 1e9:6.0f} TFLOP/s")


if __name__ == "__main__":
    print("cuDNN", cudnn_attention.unavailable_reason("gpu", DT, D) or "available", jax.devices())
    semantics()
    timings()
