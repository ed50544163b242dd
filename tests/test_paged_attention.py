"""Attention over the paged KV cache against a dense float64 reference: decode rows (groups of
one) and prompt tiles, grouped-query heads, several key chunks; and the write-then-read of a
chunk cut by the weave split."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tokenweave.nn.attention import reference_attention
from jax_tokenweave.serving.attention import attention_kernel
from jax_tokenweave.serving.attention.paged_attention import PagedAttentionRank, paged_attention
from jax_tokenweave.weave.plan import plan_batch

NB, BS, KVH, HQ, D = 12, 4, 2, 4, 8


def _single(q, k, v):
    group = q.shape[0] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    logits = np.einsum("nd,snd->ns", q, k) / np.sqrt(q.shape[-1])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("ns,snd->nd", probs, v)


@pytest.mark.parametrize("tile", [1, 4])
def test_paged_attention_matches_dense(rng, tile):
    k_cache = rng.standard_normal((NB, BS, KVH, D)).astype(np.float32)
    v_cache = rng.standard_normal((NB, BS, KVH, D)).astype(np.float32)
    width = 4  # blocks per table (2 key chunks)
    perm = rng.permutation(NB)
    tables = np.stack([perm[:4], perm[4:8], perm[8:12]]).astype(np.int32)
    # Three groups of `tile` rows, positions spread over 1..3 key chunks of 8.
    starts = [0, 5, 11] if tile == 4 else [0, 9, 15]
    positions = np.concatenate([np.arange(s, s + tile) for s in starts]).astype(np.int32)
    q = rng.standard_normal((3 * tile, HQ, D)).astype(np.float32)
    got, k_back, _ = paged_attention(
        jnp.asarray(q),
        jnp.asarray(k_cache),
        jnp.asarray(v_cache),
        jnp.asarray(tables[:, :width]),
        jnp.asarray(positions),
        tile=tile,
        key_chunk=8,
    )
    np.testing.assert_array_equal(np.asarray(k_back), k_cache)
    flat_k = k_cache[tables].reshape(3, width * BS, KVH, D)
    flat_v = v_cache[tables].reshape(3, width * BS, KVH, D)
    group = np.repeat(np.arange(3), tile)
    want = np.stack(
        [
            _single(q[i].astype(np.float64), flat_k[group[i], : p + 1], flat_v[group[i], : p + 1])
            for i, p in enumerate(positions)
        ]
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_padding_rows_stay_finite():
    zeros = jnp.zeros((NB, BS, KVH, D), jnp.float32)
    out, _, _ = paged_attention(
        jnp.ones((2, HQ, D)),
        zeros,
        zeros,
        jnp.zeros((2, 2), jnp.int32),
        jnp.zeros(2, jnp.int32),
        tile=1,
        key_chunk=8,
    )
    assert np.isfinite(np.asarray(out)).all()


def test_split_cut_chunk_reads_the_first_half_from_the_cache(rng):
    """A 12-token prompt (no earlier context) in a step of 16 rows split at 8: half B's tokens
    of the prompt see half A's K/V of the same layer through the cache; the result is causal
    attention over the whole prompt."""
    n, rows, tile = 12, 16, 4
    plan = plan_batch([rows], split=True, offset=8 - 128)
    assert plan.half_lengths == (8, 8)
    q = rng.standard_normal((rows, HQ, D)).astype(np.float32)
    k = rng.standard_normal((rows, KVH, D)).astype(np.float32)
    v = rng.standard_normal((rows, KVH, D)).astype(np.float32)
    blocks = np.array([5, 2, 9], np.int32)
    positions = np.where(np.arange(rows) < n, np.arange(rows), 0).astype(np.int32)
    slots = np.where(
        np.arange(rows) < n, blocks[positions // BS] * BS + positions % BS, NB * BS
    ).astype(np.int32)
    tables = np.zeros((rows // tile, 4), np.int32)
    tables[:3, :3] = blocks
    cache = jnp.zeros((NB, BS, KVH, D), jnp.float32)
    attention = PagedAttentionRank(
        [cache],
        [cache],
        plan.halves,
        jnp.asarray(slots),
        jnp.asarray(positions),
        jnp.asarray(tables),
        decode_rows=0,
        tile=tile,
        key_chunk=8,
    )
    outs = [
        attention(
            0,
            j,
            jnp.asarray(q[h.start : h.end]),
            jnp.asarray(k[h.start : h.end]),
            jnp.asarray(v[h.start : h.end]),
        )
        for j, h in enumerate(plan.halves)
    ]
    got = np.concatenate([np.asarray(o) for o in outs])[:n]
    want = reference_attention(q[:n], k[:n], v[:n], [n])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The padding rows wrote nothing; the prompt's K/V are in its blocks.
    cached = np.asarray(attention.k[0])[blocks].reshape(-1, KVH, D)[:n]
    np.testing.assert_array_equal(cached, k[:n])
    assert np.count_nonzero(np.asarray(attention.k[0])) == k[:n].size


def test_tile_cut_is_refused():
    cache = jnp.zeros((NB, BS, KVH, D), jnp.float32)
    plan = plan_batch([16], split=True, offset=6 - 128)  # 6 is no multiple of 4
    attention = PagedAttentionRank(
        [cache],
        [cache],
        plan.halves,
        jnp.zeros(16, jnp.int32),
        jnp.zeros(16, jnp.int32),
        jnp.zeros((4, 4), jnp.int32),
        decode_rows=0,
        tile=4,
        key_chunk=8,
    )
    x = jnp.zeros((6, HQ, D))
    with pytest.raises(ValueError, match="cut a tile"):
        attention(0, 0, x, x[:, :KVH], x[:, :KVH])


def test_jit_compiles_once_for_any_context_length(rng):
    """The key loop's trip count is a traced value: new positions do not recompile."""
    fn = jax.jit(lambda q, k, v, t, p: paged_attention(q, k, v, t, p, tile=1, key_chunk=8))
    cache = jnp.asarray(rng.standard_normal((NB, BS, KVH, D)), jnp.float32)
    tables = jnp.asarray(rng.permutation(NB)[:8].reshape(2, 4), jnp.int32)
    q = jnp.ones((2, HQ, D))
    for p in ([0, 3], [9, 15], [2, 14]):
        fn(q, cache, cache, tables, jnp.asarray(p, jnp.int32))
    assert fn._cache_size() == 1


def test_padding_rows_with_a_negative_position_get_zeros(rng):
    """A decode row with position -1 (padding) attends to nothing: zeros, not NaN; the other
    rows are unchanged by it."""
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in ((3, 4, 16), (8, 4, 2, 16), (8, 4, 2, 16))
    )
    tables = jnp.asarray(rng.permutation(8)[:6].reshape(3, 2), jnp.int32)
    positions = jnp.asarray([5, -1, 7], jnp.int32)
    out, _, _ = paged_attention(q, k, v, tables, positions, tile=1, key_chunk=4)
    alone, _, _ = paged_attention(q[::2], k, v, tables[::2], positions[::2], tile=1, key_chunk=4)
    assert not np.any(np.asarray(out[1]))
    np.testing.assert_allclose(np.asarray(out[::2]), np.asarray(alone), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("rows", "kvh", "splits"),
    [
        (1, 8, 64),  # fewer (row, kv head) pairs than blocks wanted: the most pieces
        (64, 8, 4),  # an engine's decode segment of one tile: maybe one live request
        (64, 2, 16),  # the grid stays under GRID_BLOCKS
        (66, 8, 3),  # 528 pairs fill the GPU twice; a lone live row still gets 3 pieces
        (256, 8, 1),  # 2048 pairs: the grid is full
        (300, 1, 6),
        (400, 2, 2),
    ],
)
def test_decode_splits_fill_the_gpu(rows, kvh, splits):
    assert attention_kernel.decode_splits(rows, kvh) == splits
    assert splits == 1 or rows * kvh * splits <= max(
        attention_kernel.GRID_BLOCKS, math.ceil(attention_kernel.TARGET_BLOCKS / (rows * kvh))
    )


@pytest.mark.parametrize(
    ("rows", "kvh", "splits"),
    [
        (8, 8, 4),  # a decode-only step of 1-8 requests: room for one wave
        (16, 8, 2),  # 16 rows x 8192 keys: 2 pieces each, 256 blocks of 264
        (12, 8, 2),  # 96 pairs: 192 blocks
        (32, 8, 1),  # 256 pairs: one piece each, no block exits
        (1, 8, 33),  # one request: a piece per place in the wave
        (33, 8, 1),  # a wave of pairs: one piece each
        (34, 8, 8),  # 272 pairs: a last wave of 8 blocks; room for short pieces
        (64, 8, 1),  # 512 pairs: the last wave almost full
        (99, 8, 1),  # 792 pairs: three full waves
        (256, 8, 1),
    ],
)
def test_tight_decode_splits_launch_few_idle_blocks(rows, kvh, splits):
    assert attention_kernel.decode_splits(rows, kvh, tight=True) == splits
