"""The engine's device memory: whether its KV pool fits beside the weights and a step's working
memory (checked before the pool is allocated, from the devices' allocator statistics), and
giving its arrays back (``delete_arrays``) when an engine is closed.

The statistics are JAX's ``Device.memory_stats()``: ``bytes_limit`` (what XLA's allocator may
hold: 75% of a GPU unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise) and
``bytes_in_use`` (the weights, and any other engine's arrays). Devices that report none (CPU)
are not checked. :func:`device_stats` is the one place they are read (tests replace it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_tokenweave.kernel._util import ceil_div

GIB = float(1 << 30)


def device_stats(devices: Sequence[Any]) -> list[dict[str, int] | None]:
    """``memory_stats()`` of each device (None where it reports none)."""
    return [d.memory_stats() for d in devices]


def block_bytes(model_config: Any, block_size: int, tp: int, dtype: Any) -> int:
    """Bytes of one KV cache block on each device (K and V of every layer, its KV heads)."""
    heads = ceil_div(model_config.num_kv_heads, tp)
    return (
        2
        * model_config.num_layers
        * block_size
        * heads
        * model_config.head_dim
        * jnp.dtype(dtype).itemsize
    )


def activation_reserve(model_config: Any, tokens: int, tp: int) -> int:
    """A generous bound on one step's activation bytes on a device: float32 hidden states,
    q/k/v, the MLP's intermediate and the logits of ``tokens`` rows, four times over."""
    per_row = (
        4 * model_config.hidden_size
        + 3 * model_config.intermediate_size // tp
        + model_config.vocab_size // tp
    )
    return 4 * 4 * tokens * per_row


@dataclasses.dataclass(frozen=True)
class PoolNeed:
    """Bytes on each device: the KV pool's (``blocks`` of ``block_bytes``) and a step's
    working memory beside it (``working``: activations, sampling state)."""

    blocks: int
    block_bytes: int
    working: int

    @property
    def pool(self) -> int:
        return self.blocks * self.block_bytes


def pool_need(model_config: Any, config: Any, tp: int, dtype: Any, extra: int = 0) -> PoolNeed:
    """What an engine of ``config`` (an ``EngineConfig``) needs on each of its ``tp`` devices:
    its KV pool and :func:`activation_reserve` of a step plus ``extra`` bytes."""
    return PoolNeed(
        config.num_blocks,
        block_bytes(model_config, config.block_size, tp, dtype),
        activation_reserve(model_config, config.max_num_batched_tokens, tp) + extra,
    )


def check_pool_fits(
    need: PoolNeed, devices: Sequence[Any], stats: Sequence[dict[str, int] | None] | None = None
) -> None:
    """``ValueError`` with the figures (needed, free, the blocks that would fit, how to fix)
    where ``need`` does not fit in a device's free memory (``bytes_limit - bytes_in_use``);
    ``stats`` default :func:`device_stats`. Devices without statistics pass."""
    stats = device_stats(devices) if stats is None else stats
    for device, s in zip(devices, stats, strict=True):
        if not s or "bytes_limit" not in s:
            continue
        limit, used = int(s["bytes_limit"]), int(s.get("bytes_in_use", 0))
        free = limit - used
        if need.pool + need.working <= free:
            continue
        fit = max((free - need.working) // need.block_bytes, 0)
        raise ValueError(
            f"the KV cache does not fit on {device}: num_blocks={need.blocks} blocks of "
            f"{need.block_bytes / (1 << 20):.2f} MiB need {need.pool / GIB:.2f} GiB, plus "
            f"{need.working / GIB:.2f} GiB of a step's working memory, but only "
            f"{free / GIB:.2f} GiB are free ({used / GIB:.2f} GiB of the allocator's "
            f"{limit / GIB:.2f} GiB limit in use: the weights, other engines); {fit} blocks "
            f"would fit. Lower num_blocks (or gpu_memory_utilization) or "
            f"max_num_batched_tokens, close engines no longer used, or give XLA more of the "
            f"device (XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75)"
        )


def delete_arrays(tree: Any) -> int:
    """Delete every live ``jax.Array`` among ``tree``'s leaves (their device memory returns
    to the allocator at once, whatever still refers to them); returns how many."""
    count = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()
            count += 1
    return count
