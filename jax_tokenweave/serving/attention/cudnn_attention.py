"""Prompt tiles' attention on cuDNN's flash attention over the paged cache (GPUs).

XLA builds cuDNN's causal mask top-left (row ``i`` sees keys ``<= i``), wrong for a tile after a
prefix, so each tile attends in two calls merged by log-sum-exp: its **prefix** (keys before its
first row, paged, padding mask only) and its **diagonal** (its own keys, gathered by slot, a
causal square). 128-row tiles run at about 500 TFLOP/s on an H200, against 210 for the mma.sync
tile kernel. JAX's public paged entry refuses a cache larger than ``batch x table width``; this
module calls the private one. Design and figures: docs/SERVING.md#servingattentioncudnn_attention.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_CUDNN = 90500
"""cuDNN 9.5: the first with paged K/V in its SDPA graphs."""


ENTRY_KEYWORDS = (
    *("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout"),
    *("sliding_window_length", "cudnn_version", "return_residual"),
)
"""The private entry's parameters after its ten positional ones, as jax 0.10-0.11 name them
(:func:`_sdpa` passes ten arrays by position, these by keyword)."""


@functools.cache
def _cudnn() -> tuple[Any, int] | str:
    """``(jax's cuDNN attention module, cuDNN version)``, or why there is none."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        entry = fa._dot_product_attention_fwd
        _ = (fa.MaskType.PADDING_CAUSAL, fa.AttentionLayout.BTNH)
        parameters = tuple(inspect.signature(entry).parameters)
    except Exception as err:  # any failure means "not here", with the reason
        return f"JAX's cuDNN attention cannot be loaded ({type(err).__name__}: {err})"
    if len(parameters) != 10 + len(ENTRY_KEYWORDS) or parameters[10:] != ENTRY_KEYWORDS:
        return f"JAX's private cuDNN attention entry has changed: it takes {parameters}"
    try:
        version = fa.check_cudnn_version()
    except Exception as err:
        return f"cuDNN is not available ({type(err).__name__}: {err})"
    if version < MIN_CUDNN:
        return f"cuDNN {version} is older than {MIN_CUDNN} (paged attention)"
    return fa, version


def unavailable_reason(platform: str, dtype: jnp.dtype, head_dim: int) -> str | None:
    """None where the cuDNN prompt path runs for these shapes; else why not, in one sentence."""
    if platform not in ("gpu", "cuda"):
        return f"the mesh is on {platform!r}, not on CUDA GPUs"
    if jnp.dtype(dtype) not in DTYPES:
        return f"the cache dtype is {jnp.dtype(dtype).name}; cuDNN takes bfloat16 or float16"
    if head_dim % 8 or head_dim > 128:
        return f"head_dim {head_dim} is not a multiple of 8 up to 128"
    found = _cudnn()
    return found if isinstance(found, str) else None


def _sdpa(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_len: jax.Array,
    kv_len: jax.Array,
    *,
    causal: bool,
    scale: float,
    table: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One cuDNN flash-attention call, BTNH: ``q`` [B, T, Hq, D]; ``k``, ``v`` [B, S, KVH, D]
    or, with ``table`` [B, 1, W, 1], the paged cache [NB, BS, KVH, D]; ``q_len``, ``kv_len``
    int32 [B] (a padding mask). Returns ``(out [B, T, Hq, D], lse float32 [B, Hq, T])``; a row
    with no key gets zeros and lse 0."""
    found = _cudnn()
    if isinstance(found, str):
        raise ValueError(f"cuDNN attention cannot run: {found}")
    fa, version = found
    empty = jnp.zeros(0, q.dtype)
    pages = empty if table is None else table
    mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    out, lse = fa._dot_product_attention_fwd(
        q,
        k,
        v,
        empty,  # bias: none
        q_len,
        kv_len,
        empty,  # q_offsets: not packed
        empty,  # kv_offsets
        pages,  # page_table_k
        pages,  # page_table_v
        scale=scale,
        seed=0,
        dropout_rate=0.0,
        variadic_args=(False, False),
        mask_type=mask,
        layout=fa.AttentionLayout.BTNH.value,
        sliding_window_length=None,
        cudnn_version=version,
        return_residual=True,
    )
    return out, lse


def prompt_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    tables: jax.Array,
    positions: jax.Array,
    *,
    tile: int,
    scale: float,
) -> jax.Array:
    """Causal attention of prompt tiles over their requests' paged K/V (module docstring).

    ``q`` [G * tile, Hq, D] (RoPE applied); ``k_cache``, ``v_cache`` [NB, BS, KVH, D] holding the
    tiles' own K/V already; ``tables`` int32 [G, W]; ``positions`` int32 [G * tile]: a tile's
    rows are ``p0, p0 + 1, ..`` up to its first row that breaks the run (padding). Returns
    ``out`` [G * tile, Hq, D] in q's dtype; padding rows (past a tile's run) get zeros.
    """
    rows, hq, d = q.shape
    nb, bs, kvh, _ = k_cache.shape
    groups, width = tables.shape
    if rows != groups * tile or v_cache.shape != k_cache.shape or positions.shape != (rows,):
        raise ValueError(
            f"prompt_attention (cudnn): bad shapes q {q.shape}, tile {tile}, tables "
            f"{tables.shape}, positions {positions.shape}, caches {k_cache.shape} / "
            f"{v_cache.shape}"
        )
    pos = positions.astype(jnp.int32).reshape(groups, tile)
    first = pos[:, :1]
    # The tile's run of real rows: p0, p0 + 1, .. up to the first row that breaks it.
    run = jnp.cumprod(pos == first + jnp.arange(tile, dtype=jnp.int32), axis=1).astype(bool)
    n = jnp.sum(run, axis=1, dtype=jnp.int32)  # >= 1
    p0 = jnp.maximum(first[:, 0], 0)
    qg = q.reshape(groups, tile, hq, d)
    full = jnp.full((groups,), tile, jnp.int32)
    pages = tables.astype(jnp.int32).reshape(groups, 1, width, 1)
    o_pre, l_pre = _sdpa(qg, k_cache, v_cache, full, p0, causal=False, scale=scale, table=pages)
    # The tile's own keys, by slot (a padding row's slot reads as zeros).
    slots = jnp.take_along_axis(tables, (pos // bs).clip(0, width - 1), axis=1) * bs + pos % bs
    slots = jnp.where(run, slots, nb * bs).reshape(rows)
    own = lambda c: c.reshape(nb * bs, kvh, d).at[slots].get(mode="fill", fill_value=0)
    k_own = own(k_cache).reshape(groups, tile, kvh, d)
    v_own = own(v_cache).reshape(groups, tile, kvh, d)
    o_diag, l_diag = _sdpa(qg, k_own, v_own, n, n, causal=True, scale=scale)
    out = _merge(o_pre, l_pre, o_diag, l_diag, p0 > 0)
    # cuDNN may leave NaNs where a row has no key (an empty prefix, rows past n): select.
    return jnp.where(run[..., None, None], out, 0.0).reshape(rows, hq, d).astype(q.dtype)


def _merge(
    o_pre: jax.Array, l_pre: jax.Array, o_diag: jax.Array, l_diag: jax.Array, has_prefix: jax.Array
) -> jax.Array:
    """Softmax-weighted sum of two partial attentions: ``o`` [G, T, Hq, D], ``l`` [G, Hq, T]
    (log-sum-exp of each part's scaled logits); ``has_prefix`` [G] (else the prefix part is
    ignored, whatever it holds). Exact for rows whose diagonal part has a key."""
    l_pre = jnp.swapaxes(l_pre, 1, 2)  # [G, T, Hq]
    l_diag = jnp.swapaxes(l_diag, 1, 2)
    use = has_prefix[:, None, None]
    top = jnp.where(use, jnp.maximum(l_pre, l_diag), l_diag)
    w_pre = jnp.where(use, jnp.exp(l_pre - top), 0.0)
    w_diag = jnp.exp(l_diag - top)  # one of the two weights is 1
    o_pre = jnp.where(use[..., None], o_pre.astype(jnp.float32), 0.0)
    out = o_pre * w_pre[..., None] + o_diag.astype(jnp.float32) * w_diag[..., None]
    return out / (w_pre + w_diag)[..., None]
