"""Attention over the paged KV cache for a packed step, per tensor-parallel rank.

:func:`paged_attention` takes queries in groups of ``tile`` rows of one request (a decode token: a
group of one), each group with its block table; a row at position ``p`` attends to its request's
keys ``0..p``, written before the read (:class:`PagedAttention`). Implementations: ``"xla"``
(pure-JAX online softmax, the reference), ``"cuda"`` (``serving.attention.attention_kernel``),
``"cudnn"`` (decode rows as ``"cuda"``, prompt tiles on cuDNN:
``serving.attention.cudnn_attention``), ``"auto"`` (:func:`resolve_implementation`). The caches are
threaded through each read so XLA updates them in place. Design:
docs/SERVING.md#servingattentionpaged_attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.serving.attention import attention_kernel, cudnn_attention, paged_cache
from jax_tokenweave.weave.plan import Half

ATTENTION_IMPLS = ("auto", "cudnn", "cuda", "xla")


def resolve_implementation(
    implementation: str, platform: str, dtype: jnp.dtype, head_dim: int, group: int
) -> str:
    """``"cudnn"``, ``"cuda"`` or ``"xla"`` for ``implementation`` in :data:`ATTENTION_IMPLS`:
    ``"auto"`` takes the first that can run here (the CUDA kernels need
    :func:`attention_kernel.unavailable_reason` None; ``"cudnn"`` needs them and
    :func:`cudnn_attention.unavailable_reason` None); an explicit choice that cannot run raises
    ``ValueError`` with the reason."""
    if implementation not in ATTENTION_IMPLS:
        raise ValueError(
            f"attention implementation must be one of {ATTENTION_IMPLS}, got {implementation!r}"
        )
    if implementation == "xla":
        return "xla"
    why = attention_kernel.unavailable_reason(platform, dtype, head_dim, group)
    if why is None and implementation in ("auto", "cudnn"):
        why_cudnn = cudnn_attention.unavailable_reason(platform, dtype, head_dim)
        if why_cudnn is None:
            return "cudnn"
        if implementation == "cudnn":
            raise ValueError(f"attention implementation 'cudnn' cannot run: {why_cudnn}")
    if why is None:
        return "cuda"
    if implementation == "auto":
        return "xla"
    raise ValueError(f"attention implementation {implementation!r} cannot run: {why}")


def resolve_for(implementation: str, platform: str, dtype: jnp.dtype, config: DecoderConfig) -> str:
    """:func:`resolve_implementation` for a model's heads (``config``) and cache ``dtype``."""
    group = config.num_heads // config.num_kv_heads
    return resolve_implementation(implementation, platform, dtype, config.head_dim, group)


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
    """Causal attention of query groups over their requests' paged K/V.

    ``q`` [G * tile, Hq, D] (RoPE applied); ``k_cache``, ``v_cache`` [NB, BS, KVH, D] (one layer,
    this rank's heads); ``tables`` int32 [G, W] (W a multiple of ``key_chunk / BS``); ``positions``
    int32 [G * tile] (< 0: padding, attends to nothing, gets zeros). ``tile``: rows per group;
    ``key_chunk``: keys per step of the ``"xla"`` loop. ``implementation``: ``"xla"``,
    ``"cuda"`` or ``"cudnn"`` (resolve ``"auto"`` first); ``tight``: decode rows at most half
    padding (sizes the CUDA grid).
    Returns ``(out [G * tile, Hq, D] in q's dtype, k_cache, v_cache)``: write the next K/V into
    these caches (in place); docs/SERVING.md#servingattentionpaged_attentionpaged_attention.
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
    if implementation == "cudnn" and tile > 1:
        out = cudnn_attention.prompt_attention(
            q, k_cache, v_cache, tables, positions, tile=tile, scale=scale
        )
        # The next write of the caches must follow this read, which XLA sees through the
        # barrier (else it may copy a whole cache to let the two overlap).
        return jax.lax.optimization_barrier((out, k_cache, v_cache))
    if implementation in ("cuda", "cudnn"):
        return attention_kernel.paged_attention(
            q, k_cache, v_cache, tables, positions, tile=tile, scale=scale, tight=tight
        )
    if implementation != "xla":
        raise ValueError(
            f"paged_attention: implementation must be 'xla', 'cuda' or 'cudnn' (resolve "
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
    """A packed step's attention over the paged cache, as the serving step passes it to
    ``nn.forward.decoder_forward`` (a ``StackAttention``): its operands are the step's
    ``positions``, ``slots`` [R] and ``tables`` [groups, W] (``serving.runner.batch``, replicated)
    and ``cache`` (sharded over kv heads); its results, the cache with the step's K/V written.
    ``decode_rows``, ``tile``: the layout's (``batch.StepLayout``).
    """

    def __init__(
        self,
        cache: paged_cache.PagedKVCache,
        positions: jax.Array | np.ndarray,
        slots: jax.Array | np.ndarray,
        tables: jax.Array | np.ndarray,
        *,
        decode_rows: int,
        tile: int,
    ) -> None:
        self.cache = cache
        self.positions, self.slots, self.tables = positions, slots, tables
        self.decode_rows, self.tile = decode_rows, tile

    def resolve(self, requested: str, platform: str, dtype: Any, config: DecoderConfig) -> str:
        """:func:`resolve_for` the cache's dtype (``dtype``, the model's, is the same)."""
        return resolve_for(requested, platform, self.cache.k[0].dtype, config)

    def operands(self) -> tuple[Any, ...]:
        return (self.positions, self.slots, self.tables, self.cache.k, self.cache.v)

    def specs(self, axis_name: str) -> tuple[Any, Any]:
        layers = [paged_cache.cache_spec(axis_name)] * len(self.cache.k)
        return (P(), P(), P(), layers, layers), (layers, layers)

    def bind(
        self, operands: Any, halves: tuple[Half, ...], implementation: str, key_chunk: int
    ) -> PagedAttentionRank:
        positions, slots, tables, k, v = operands
        return PagedAttentionRank(
            k,
            v,
            halves,
            slots,
            positions,
            tables,
            decode_rows=self.decode_rows,
            tile=self.tile,
            key_chunk=key_chunk,
            implementation=implementation,
        )


class PagedAttentionRank:
    """The stack's attention function (``stack.RankAttention``) for a packed step, per rank.

    For half ``j`` of layer ``i``: write the half's K/V into layer ``i``'s cache at the rows'
    slots, then attend (:func:`paged_attention`) with the decode rows as groups of one and the
    chunk rows as groups of ``tile``. ``k``, ``v``: the per-layer caches (updated as the layers
    run); ``slots``, ``positions`` [R]; ``tables`` [groups, W] (``serving.runner.batch``);
    ``implementation``: ``"xla"``, ``"cuda"`` or ``"cudnn"`` (:func:`paged_attention`).
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

    def half_positions(self, j: int) -> jax.Array:
        """Half ``j``'s rows' positions [T_j]."""
        return self.positions[self.halves[j].start : self.halves[j].end]

    def results(self) -> tuple[list[jax.Array], list[jax.Array]]:
        """The caches ``(k, v)``, the step's K/V written."""
        return self.k, self.v

    @property
    def fuses_rope(self) -> bool:
        """With the CUDA kernels, RoPE and the cache write are one kernel
        (:meth:`rope_and_attend`; ``stack.run_stack`` calls it)."""
        return self.implementation in ("cuda", "cudnn")

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
