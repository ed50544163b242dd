"""Contiguous KV cache, sharded over KV heads.

Layout: ``k`` and ``v`` are ``[L, B, S, KVH, D]`` (layers, cache rows, max sequence length,
KV heads, head dim), ``NamedSharding(mesh, P(None, None, None, axis, None))``: each rank holds
the K/V of its own ``KVH / N`` heads, the heads its column-parallel q/k/v projection produces,
so neither prefill nor decode moves K/V between ranks.

Contiguous, not paged: one sequence owns one *cache row* ``b`` (positions ``[0, S)`` of every
layer); its token at position ``p`` lives at position ``p`` of the row. Positions at or past a
sequence's length hold stale data (prompt padding or an earlier sequence) and are masked in
attention, so a cache row is reused without clearing. ``S`` and ``B`` are fixed when the cache
is made, which gives every step a static shape; the cost is memory for ``B * S`` tokens whatever
the actual lengths.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_tokenweave.config import DecoderConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer: ``k``, ``v`` [L, B, S, KVH, D] (module docstring)."""

    k: jax.Array
    v: jax.Array

    @property
    def num_rows(self) -> int:
        """Cache rows ``B``: sequences held at once."""
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """Positions per cache row ``S``."""
        return self.k.shape[2]


def cache_spec(axis_name: str = "tp") -> PartitionSpec:
    """The cache's partition spec: KV heads (axis 3) over ``axis_name``."""
    return PartitionSpec(None, None, None, axis_name, None)


def init_cache(config: DecoderConfig, mesh: Mesh, num_rows: int, max_len: int, dtype,
               axis_name: str = "tp") -> KVCache:
    """A zeroed cache of ``num_rows`` cache rows (sequences) of up to ``max_len`` tokens."""
    if num_rows < 1 or max_len < 1:
        raise ValueError(f"need num_rows >= 1 and max_len >= 1, got {num_rows}, {max_len}")
    config.check_tensor_parallel(mesh.shape[axis_name])
    shape = (config.num_layers, num_rows, max_len, config.num_kv_heads, config.head_dim)
    sharding = NamedSharding(mesh, cache_spec(axis_name))
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return KVCache(zeros(), zeros())


def write_prompts(cache: KVCache, layer: int, k: jax.Array, v: jax.Array,
                  rows: jax.Array) -> KVCache:
    """Write one layer's prompt K/V into the cache.

    ``k``, ``v``: [P, Lb, KVH, D], ``P`` prompts each padded to ``Lb`` tokens; ``rows``: int32
    [P], the cache row of each prompt; a row ``>= num_rows`` marks a padding prompt, not written.
    """
    lb = k.shape[1]
    if lb > cache.max_len:
        raise ValueError(f"prompt bucket of {lb} tokens exceeds the cache length {cache.max_len}")
    new_k = cache.k.at[layer, rows, :lb].set(k.astype(cache.k.dtype), mode="drop")
    new_v = cache.v.at[layer, rows, :lb].set(v.astype(cache.v.dtype), mode="drop")
    return KVCache(new_k, new_v)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     positions: jax.Array) -> jax.Array:
    """Per rank: each cache row's query attends to its cached keys at ``0..positions[b]``.

    ``q`` [B, H_r, D] (``H_r`` a multiple of ``KVH_r``; query head ``h`` uses KV head
    ``h // (H_r // KVH_r)``), caches [B, S, KVH_r, D], ``positions`` int32 [B]. Returns
    [B, H_r * D] in ``q.dtype``; softmax in float32.
    """
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    qg = q.reshape(b, kvh, h // kvh, d).astype(jnp.float32)
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, k_cache.astype(jnp.float32)) / jnp.sqrt(
        jnp.float32(d))
    visible = jnp.arange(k_cache.shape[1])[None, :] <= positions[:, None]  # [B, S]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgs,bskd->bkgd", probs, v_cache.astype(jnp.float32))
    return out.reshape(b, h * d).astype(q.dtype)
