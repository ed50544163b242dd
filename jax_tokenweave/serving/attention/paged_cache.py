"""The paged KV cache: fixed-size blocks of token positions, sharded over KV heads.

Per layer ``k``, ``v``: [num_blocks, block_size, KVH, D], ``P(None, None, axis, None)`` (each
rank its ``KVH / N`` heads); a list of buffers, updated in place. Position ``p`` lives in block
``table[p // block_size]``, slot ``block * block_size + p % block_size``; unwritten positions
are never read, so blocks are reused uncleared. See docs/SERVING.md#servingattentionpaged_cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_tokenweave.config import DecoderConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """``k``, ``v``: per layer ``[num_blocks, block_size, KVH, D]`` (module docstring)."""

    k: list[jax.Array]
    v: list[jax.Array]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]


def cache_spec(axis_name: str = "tp") -> PartitionSpec:
    """One layer's partition spec: KV heads (axis 2) over ``axis_name``."""
    return PartitionSpec(None, None, axis_name, None)


def init_paged_cache(
    config: DecoderConfig,
    mesh: Mesh,
    num_blocks: int,
    block_size: int,
    dtype: jnp.dtype,
    axis_name: str = "tp",
) -> PagedKVCache:
    """A zeroed cache of ``num_blocks`` blocks of ``block_size`` positions per layer."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(
            f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
        )
    config.check_tensor_parallel(mesh.shape[axis_name])
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    zeros = jax.jit(
        lambda: jnp.zeros(shape, dtype), out_shardings=NamedSharding(mesh, cache_spec(axis_name))
    )
    return PagedKVCache(
        [zeros() for _ in range(config.num_layers)], [zeros() for _ in range(config.num_layers)]
    )


def write(cache: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """Per rank: ``values`` [T, KVH/N, D] written at cache ``slots`` [T] of one layer's
    ``cache`` [NB, BS, KVH/N, D]; a slot ``>= NB * BS`` (padding) is dropped."""
    bs = cache.shape[1]
    return cache.at[slots // bs, slots % bs].set(values.astype(cache.dtype), mode="drop")
