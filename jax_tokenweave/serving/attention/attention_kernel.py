"""The CUDA paged-attention kernels (``ffi/attention/paged_attention.h``) as a JAX operation.

One FFI custom call, ``tokenweave_paged_attention``, per attention segment, per rank (inside
``shard_map``): ``tile == 1`` a split-K decode kernel, ``tile > 1`` a tensor-core flash-attention
kernel. Block tables and positions are read on the device (command buffers capture the call); the
caches come back aliased to their inputs. Kernel design:
docs/SERVING.md#servingattentionattention_kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_tokenweave.kernel import _extension

TARGET = "tokenweave_paged_attention"
ROPE_TARGET = "tokenweave_rope_cache_write"
HEAD_DIMS = (64, 128)
GROUPS = (1, 2, 4, 8)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
TARGET_BLOCKS = 2 * 132
"""Decode blocks the GPU holds at once: two per multiprocessor of an H100/H200 (96 KiB of
shared memory each; the kernel reads the real count at launch)."""
MAX_SPLITS = 64
"""The most pieces a decode row's context is cut into (the handler allows 256)."""
TAIL_SPLITS = 8
"""A decode-only step's splits where its pairs leave the last wave under half full (the kernel
then cuts rows into pieces of 256 keys, so the blocks left alone at the end are short)."""
GRID_BLOCKS = 2048
"""Decode grid to stay under where rows may be mostly padding (most of its blocks exit, each
holding its 96 KiB of shared memory while it does)."""


def unavailable_reason(platform: str, dtype: jnp.dtype, head_dim: int, group: int) -> str | None:
    """None where the CUDA kernels run for these shapes; else why not, in one sentence."""
    if _extension.import_error() is not None:
        return f"the CUDA extension is not built ({_extension.import_error()})"
    if platform not in ("gpu", "cuda"):
        return f"the mesh is on {platform!r}, not on CUDA GPUs"
    if jnp.dtype(dtype) not in DTYPES:
        return f"the cache dtype is {jnp.dtype(dtype).name}; the kernels take bfloat16 or float16"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {HEAD_DIMS}"
    if group not in GROUPS:
        return f"{group} query heads per kv head is not one of {GROUPS}"
    return None


@functools.cache
def _register() -> None:
    handlers = _extension.get().attention_handlers()
    jax.ffi.register_ffi_target(TARGET, handlers["paged_attention"], platform="CUDA")
    jax.ffi.register_ffi_target(ROPE_TARGET, handlers["rope_cache_write"], platform="CUDA")


def decode_splits(rows: int, kv_heads: int, tight: bool = False) -> int:
    """Blocks per (decode row, kv head): the most pieces a row's context is cut into. The
    kernel cuts rows into pieces (of at least 64 keys) that keep the live pairs' blocks in one
    wave; past a wave, one piece each, or pieces of 256 keys where the last wave is under half
    full. ``tight`` (a decode-only step, rows at most half padding): the pieces the kernel
    takes for ``rows`` live rows under one wave of :data:`TARGET_BLOCKS` blocks, so no block
    exits unused (fewer live rows keep that many pieces: their blocks take no longer), or
    :data:`TAIL_SPLITS` against a short last wave. Else the rows may be mostly padding (a
    mixed step pads its decode segment to a prompt tile) and a lone request must still spread
    over the GPU: a grid of up to :data:`GRID_BLOCKS`. At most :data:`MAX_SPLITS`. A grid of
    2 within one block per SM runs rows whole in 8-warp blocks (docs/SERVING.md)."""
    pairs = rows * kv_heads
    if not tight:
        need = math.ceil(TARGET_BLOCKS / pairs)
        return max(1, min(MAX_SPLITS, max(need, GRID_BLOCKS // pairs)))
    if pairs >= TARGET_BLOCKS:
        last = pairs % TARGET_BLOCKS
        return TAIL_SPLITS if 0 < 2 * last < TARGET_BLOCKS else 1
    # The pieces the kernel takes when every row is live: no block of the grid exits unused (a
    # block that exits still holds a place in the first wave while it reads its row's position).
    return min(MAX_SPLITS, TARGET_BLOCKS // pairs)


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    tables: jax.Array,
    positions: jax.Array,
    *,
    tile: int,
    scale: float,
    tight: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``serving.attention.paged_attention.paged_attention`` on the CUDA kernels (module docstring).

    ``q`` [G * tile, Hq, D]; ``k_cache``, ``v_cache`` [NB, BS, KVH, D] (q's dtype); ``tables``
    int32 [G, W]; ``positions`` int32 [G * tile] (decode rows: < 0 for padding). Returns
    ``(out [G * tile, Hq, D], k_cache, v_cache)``, the caches aliased to the inputs.
    """
    rows, hq, d = q.shape
    kvh = k_cache.shape[2]
    groups = tables.shape[0]
    why = unavailable_reason("gpu", q.dtype, d, hq // kvh if hq % kvh == 0 else 0)
    if why is not None:
        raise ValueError(f"paged_attention (cuda): {why}")
    if (
        k_cache.dtype != q.dtype
        or v_cache.shape != k_cache.shape
        or v_cache.dtype != q.dtype
        or k_cache.shape[3] != d
        or rows != groups * tile
    ):
        raise ValueError(
            f"paged_attention (cuda): bad shapes q {q.shape} {q.dtype}, caches "
            f"{k_cache.shape} {k_cache.dtype} / {v_cache.shape} {v_cache.dtype}, "
            f"tables {tables.shape}, tile {tile}"
        )
    _register()
    group = hq // kvh
    splits = decode_splits(groups, kvh, tight) if tile == 1 else 0
    # Decode partials: per (row, kv head, split, head of the group) D sums and (max, total).
    work = (groups * kvh * splits * group * (d + 2),) if tile == 1 else (1,)
    outs = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
        jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        jax.ShapeDtypeStruct(work, jnp.float32),
    )
    positions = positions.astype(jnp.int32)
    # Live decode rows: how finely the kernel cuts each row (the prompt-tile kernel ignores it).
    live = jnp.sum(positions >= 0, dtype=jnp.int32).reshape(1)
    call = jax.ffi.ffi_call(TARGET, outs, input_output_aliases={1: 1, 2: 2})
    out, k_cache, v_cache, _ = call(
        q,
        k_cache,
        v_cache,
        tables.astype(jnp.int32),
        positions,
        live,
        tile=np.int32(tile),
        splits=np.int32(splits),
        scale=np.float32(scale),
    )
    return out, k_cache, v_cache


def rope_cache_write(
    qkv: jax.Array,
    positions: jax.Array,
    slots: jax.Array,
    inv_freq: np.ndarray,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    num_q_heads: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """RoPE and the cache write of one step's rows in one CUDA kernel
    (``ffi/attention/rope_cache.h``), per rank: what ``attention.apply_rope`` on q and k and two
    ``paged_cache.write`` compute.

    ``qkv`` [R, Hq + 2 KVH, D] (the projection's heads in the order q, k, v); ``positions``,
    ``slots`` int32 [R] (a slot outside the cache is dropped); ``inv_freq`` [D / 2];
    ``k_cache``, ``v_cache`` [NB, BS, KVH, D] in qkv's dtype. Returns ``(q [R, Hq, D],
    k_cache, v_cache)``, the caches aliased to the inputs.
    """
    rows, heads, d = qkv.shape
    kvh = k_cache.shape[2]
    if jnp.dtype(qkv.dtype) not in DTYPES or d % 16 or heads != num_q_heads + 2 * kvh:
        raise ValueError(
            f"rope_cache_write (cuda): qkv {qkv.shape} {qkv.dtype} does not hold "
            f"{num_q_heads} query heads and 2 x {kvh} kv heads of a multiple of 16 "
            f"in bfloat16 or float16"
        )
    if (
        k_cache.dtype != qkv.dtype
        or v_cache.dtype != qkv.dtype
        or v_cache.shape != k_cache.shape
        or k_cache.shape[3] != d
        or positions.shape != (rows,)
        or slots.shape != (rows,)
        or np.shape(inv_freq) != (d // 2,)
    ):
        raise ValueError(
            f"rope_cache_write (cuda): bad shapes qkv {qkv.shape}, caches "
            f"{k_cache.shape} {k_cache.dtype} / {v_cache.shape}, positions "
            f"{positions.shape}, slots {slots.shape}, inv_freq {np.shape(inv_freq)}"
        )
    _register()
    outs = (
        jax.ShapeDtypeStruct((rows, num_q_heads, d), qkv.dtype),
        jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
        jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
    )
    call = jax.ffi.ffi_call(ROPE_TARGET, outs, input_output_aliases={4: 1, 5: 2})
    q, k_cache, v_cache = call(
        qkv,
        positions.astype(jnp.int32),
        slots.astype(jnp.int32),
        jnp.asarray(inv_freq, jnp.float32),
        k_cache,
        v_cache,
    )
    return q, k_cache, v_cache
