"""Attention over the paged KV cache for a packed step: prefill chunks and decode tokens in
one batch, one code path, per tensor-parallel rank.

:func:`paged_attention` takes queries in *groups* of ``tile`` consecutive rows that belong to
one request (a decode token is a group of one, a prompt chunk is cut into tiles); each group
has the block table of its request, each row its position ``p``. A row attends to its
request's cached keys at positions ``0..p``: the earlier steps' tokens and, because a step
writes its K/V into the cache *before* reading (:class:`PagedAttention`), the step's own
earlier tokens of the same request (causal within a chunk). The keys are read ``key_chunk``
positions at a time (gathered through the block table) under an online softmax, for as many
chunks as the largest position needs (a dynamic trip count: compute follows the real context
length, shapes stay static). Math in float32; grouped-query attention (query head ``h`` uses
kv head ``h // (Hq / KVH)``).

Two implementations compute the same function (``implementation=``): ``"xla"``, the pure-JAX
key loop below (the CPU path and the reference the GPU tests compare with), and ``"cuda"``, the
CUDA kernels of the extension (``serving.attention_kernel``: a split-K decode kernel for groups
of one row, a tensor-core flash-attention kernel for prompt tiles), which read each key and
value once per group straight from the paged cache. ``"auto"`` (:func:`resolve_implementation`)
takes ``"cuda"`` where it can run.

A request cut by the weave split: half A writes its rows' K/V, then half B's rows of the same
request read them from the cache (same layer), so no prefix has to be passed around.

In place: the cache buffers go write (A) -> read loop (A) -> write (B) -> read loop (B) as one
chain of values: each read loop carries the caches through its state and hands them on (an
``optimization_barrier`` in the body keeps XLA from seeing a mere pass-through and forwarding the
loop's input to the next write, which would make the read and the write overlap and XLA copy
the whole cache per layer and half; ``tests/test_serving.py`` checks the compiled step for such
copies).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_tokenweave.serving import attention_kernel, paged_cache
from jax_tokenweave.weave.plan import Half

ATTENTION_IMPLS = ("auto", "cuda", "xla")


def resolve_implementation(
    implementation: str, platform: str, dtype: jnp.dtype, head_dim: int, group: int
) -> str:
    """``"cuda"`` or ``"xla"`` for ``implementation`` in :data:`ATTENTION_IMPLS`: ``"auto"``
    takes the CUDA kernels where they can run (:func:`attention_kernel.unavailable_reason` is
    None) and the pure-JAX loop elsewhere; an explicit ``"cuda"`` that cannot run raises
    ``ValueError`` with the reason."""
    if implementation not in ATTENTION_IMPLS:
        raise ValueError(
            f"attention implementation must be one of {ATTENTION_IMPLS}, got {implementation!r}"
        )
    if implementation == "xla":
        return "xla"
    why = attention_kernel.unavailable_reason(platform, dtype, head_dim, group)
    if why is None:
        return "cuda"
    if implementation == "cuda":
        raise ValueError(f"attention implementation 'cuda' cannot run: {why}")
    return "xla"


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    tables: jax.Array,
    positions: jax.Array,
    *,
    tile: int,
    key_chunk: int,
    scale: float | None = None,
    implementation: str = "xla",
    tight: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal attention of query groups over their requests' paged K/V (module docstring).

    Args:
      q: [G * tile, Hq, D] queries (RoPE applied), in groups of ``tile`` rows.
      k_cache, v_cache: one layer's cache [NB, BS, KVH, D] (this rank's heads).
      tables: int32 [G, W] block table per group; ``W`` a multiple of ``key_chunk / BS``.
      positions: int32 [G * tile], each row's position in its request (< 0: padding, which
        attends to nothing and gets zeros).
      tile: rows per group; key_chunk: keys per loop step (a multiple of BS; the pure-JAX
        loop's, the CUDA kernels choose their own).
      implementation: ``"xla"`` (the pure-JAX loop) or ``"cuda"`` (module docstring; resolve
        ``"auto"`` first with :func:`resolve_implementation`).
      tight: decode rows (``tile == 1``) that are at most half padding (a decode-only step):
        the CUDA kernel's grid then has no more pieces per row than the live rows need
        (``attention_kernel.decode_splits``).
    Returns:
      ``(out [G * tile, Hq, D] in q's dtype, k_cache, v_cache)``: the caches come back
      unchanged, threaded through the key loop; write the next K/V into *these* (module
      docstring: so XLA updates the cache in place).
    """
    rows, hq, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    groups, per_chunk = rows // tile, key_chunk // bs
    if rows % tile or tables.shape[0] != groups or key_chunk % bs:
        raise ValueError(
            f"bad paged attention shapes: q {q.shape}, tile {tile}, tables "
            f"{tables.shape}, key_chunk {key_chunk}, block size {bs}"
        )
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if implementation == "cuda":
        return attention_kernel.paged_attention(
            q, k_cache, v_cache, tables, positions, tile=tile, scale=scale, tight=tight
        )
    if implementation != "xla":
        raise ValueError(
            f"paged_attention: implementation must be 'xla' or 'cuda' (resolve "
            f"'auto' with resolve_implementation), got {implementation!r}"
        )
    qg = q.reshape(groups, tile, kvh, hq // kvh, d)
    pos = positions.reshape(groups, tile)
    stat_shape = (groups, tile, kvh, hq // kvh)

    def body(c: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m, total, acc, k_cache, v_cache = carry
        blocks = jax.lax.dynamic_slice_in_dim(tables, c * per_chunk, per_chunk, axis=1)
        keys = k_cache[blocks].reshape(groups, key_chunk, kvh, d)
        values = v_cache[blocks].reshape(groups, key_chunk, kvh, d)
        s = (
            jnp.einsum(
                "ntkgd,nckd->ntkgc", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32
            )
            * scale
        )
        visible = c * key_chunk + jnp.arange(key_chunk) <= pos[:, :, None]  # [G, tile, C]
        s = jnp.where(visible[:, :, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        correction = jnp.exp(m - m_safe)
        total = total * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum(
            "ntkgc,nckd->ntkgd", p.astype(v_cache.dtype), values, preferred_element_type=jnp.float32
        )
        # Not a pass-through: XLA would forward it and see the loop's read beside a later
        # write of the same buffer (module docstring).
        k_cache, v_cache = jax.lax.optimization_barrier((k_cache, v_cache))
        return m_new, total, acc, k_cache, v_cache

    init = (
        jnp.full(stat_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stat_shape, jnp.float32),
        jnp.zeros((*stat_shape, d), jnp.float32),
        k_cache,
        v_cache,
    )
    num_chunks = jnp.max(positions) // key_chunk + 1
    _, total, acc, k_cache, v_cache = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(rows, hq, d).astype(q.dtype), k_cache, v_cache


class PagedAttention:
    """The stack's attention function (``stack.AttentionFn``) for a packed step, per rank.

    For half ``j`` of layer ``i``: write the half's K/V into layer ``i``'s cache at the rows'
    slots, then attend (:func:`paged_attention`) with the decode rows as groups of one and the
    chunk rows as groups of ``tile``. ``k``, ``v``: the per-layer caches (updated as the layers
    run); ``slots``, ``positions`` [R]; ``tables`` [groups, W] (``serving.batch``);
    ``implementation``: ``"xla"`` or ``"cuda"`` (:func:`paged_attention`).
    """

    def __init__(
        self,
        k: Sequence[jax.Array],
        v: Sequence[jax.Array],
        halves: Sequence[Half],
        slots: jax.Array,
        positions: jax.Array,
        tables: jax.Array,
        *,
        decode_rows: int,
        tile: int,
        key_chunk: int,
        implementation: str = "xla",
    ) -> None:
        self.k, self.v = list(k), list(v)
        self.halves = tuple(halves)
        self.slots, self.positions, self.tables = slots, positions, tables
        self.decode_rows, self.tile, self.key_chunk = decode_rows, tile, key_chunk
        self.implementation = implementation
        # A decode-only step (no prompt rows) pads its decode rows to a power of two, not a tile.
        self.decode_only = positions.shape[0] == decode_rows
        # Padding decode rows (their slot is past the cache) attend to nothing: position -1.
        num_slots = self.k[0].shape[0] * self.k[0].shape[1]
        self.decode_positions = jnp.where(
            slots[:decode_rows] < num_slots, positions[:decode_rows], -1
        )

    @property
    def fuses_rope(self) -> bool:
        """With the CUDA kernels, RoPE and the cache write are one kernel
        (:meth:`rope_and_attend`; ``stack.run_stack`` calls it)."""
        return self.implementation == "cuda"

    def __call__(self, layer: int, j: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        lo, hi = self.halves[j].start, self.halves[j].end
        self.k[layer] = paged_cache.write(self.k[layer], self.slots[lo:hi], k)
        self.v[layer] = paged_cache.write(self.v[layer], self.slots[lo:hi], v)
        return self._attend(layer, lo, hi, q)

    def rope_and_attend(
        self, layer: int, j: int, qkv: jax.Array, nq: int, inv_freq: np.ndarray
    ) -> jax.Array:
        """As ``__call__``, from the projection's heads before RoPE (``qkv`` [T_j, heads, D],
        q's ``nq`` first): RoPE and the K/V write in one CUDA kernel
        (``attention_kernel.rope_cache_write``), then the attention."""
        lo, hi = self.halves[j].start, self.halves[j].end
        q, self.k[layer], self.v[layer] = attention_kernel.rope_cache_write(
            qkv,
            self.positions[lo:hi],
            self.slots[lo:hi],
            inv_freq,
            self.k[layer],
            self.v[layer],
            num_q_heads=nq,
        )
        return self._attend(layer, lo, hi, q)

    def _attend(self, layer: int, lo: int, hi: int, q: jax.Array) -> jax.Array:
        """Rows [lo, hi) of the step attend over layer ``layer``'s cache (written)."""
        d, tile = self.decode_rows, self.tile
        parts = []
        for a, b, size, first_group in (
            (lo, min(hi, d), 1, lo),
            (max(lo, d), hi, tile, d + (max(lo, d) - d) // tile),
        ):
            if a >= b:
                continue
            if (a - d) % size or (b - a) % size:
                raise ValueError(f"rows [{a}, {b}) cut a tile of {size} rows")
            groups = (b - a) // size
            out, self.k[layer], self.v[layer] = paged_attention(
                q[a - lo : b - lo],
                self.k[layer],
                self.v[layer],
                self.tables[first_group : first_group + groups],
                self.decode_positions[a:b] if size == 1 else self.positions[a:b],
                tile=size,
                key_chunk=self.key_chunk,
                implementation=self.implementation,
                tight=self.decode_only,
            )
            parts.append(out)
        return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
