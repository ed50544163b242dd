"""The cuDNN prompt path's decomposition (a paged prefix call and a causal diagonal call, merged by
log-sum-exp) against a float64 reference, on CPU: cuDNN is stood in for by a float32 function
with the semantics the GPU test pins (``test_paged_attention_gpu``): top-left causal mask, padding
by lengths, and NaNs for a row with no key (cuDNN gives zeros or NaNs there, by shape). Plus the
choice of implementation."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tokenweave.serving.attention import cudnn_attention
from jax_tokenweave.serving.attention.paged_attention import resolve_implementation


def _stand_in(q, k, v, q_len, kv_len, *, causal, scale, table=None):
    """cuDNN's SDPA as XLA runs it: q [B, T, Hq, D]; k, v [B, S, KVH, D] or paged."""
    if table is not None:
        blocks = table[:, 0, :, 0]  # [B, W]
        k = k[blocks].reshape(blocks.shape[0], -1, *k.shape[2:])
        v = v[blocks].reshape(blocks.shape[0], -1, *v.shape[2:])
    group = q.shape[2] // k.shape[2]
    k = jnp.repeat(k.astype(jnp.float32), group, axis=2)
    v = jnp.repeat(v.astype(jnp.float32), group, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k) * scale
    t, keys = jnp.arange(q.shape[1]), jnp.arange(k.shape[1])
    ok = (keys[None, None, :] < kv_len[:, None, None]) & (t[None, :, None] < q_len[:, None, None])
    if causal:
        ok &= keys[None, None, :] <= t[None, :, None]
    ok = ok[:, None]  # [B, 1, T, S]
    s = jnp.where(ok, s, -jnp.inf)
    any_key = ok.any(-1)
    lse = jnp.where(any_key, jax.nn.logsumexp(jnp.where(ok, s, -1e30), axis=-1), jnp.nan)
    p = jnp.where(ok, jnp.exp(s - lse[..., None]), 0.0)
    out = jnp.einsum("bhts,bshd->bthd", p, v)
    out = jnp.where(jnp.swapaxes(any_key, 1, 2)[..., None], out, jnp.nan)
    return out.astype(q.dtype), lse


def _reference(q, k_cache, v_cache, tables, positions, tile, live):
    """Float64: live row r attends to its tile's request positions 0..positions[r]."""
    q, k_cache, v_cache = (np.asarray(a, np.float64) for a in (q, k_cache, v_cache))
    _, hq, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = np.zeros_like(q)
    for r in np.flatnonzero(live):
        slots = np.arange(positions[r] + 1)
        table = tables[r // tile]
        keys = np.repeat(k_cache[table[slots // bs], slots % bs], hq // kvh, axis=1)
        values = np.repeat(v_cache[table[slots // bs], slots % bs], hq // kvh, axis=1)
        logits = np.einsum("hd,shd->hs", q[r], keys) / np.sqrt(d)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        out[r] = np.einsum("hs,shd->hd", probs / probs.sum(-1, keepdims=True), values)
    return out


@pytest.mark.parametrize(("hq", "kvh", "bs"), [(8, 2, 4), (4, 4, 8)])
def test_prefix_and_diagonal_merge_to_causal_attention(rng, monkeypatch, hq, kvh, bs):
    monkeypatch.setattr(cudnn_attention, "_sdpa", _stand_in)
    tile, d, width = 8, 16, 12
    nb = 4 * width + 5
    tables = rng.permutation(nb)[: 4 * width].reshape(4, width).astype(np.int32)
    tables[1] = tables[0]  # tiles 0 and 1: one request, tile 1 after tile 0
    k_cache = rng.standard_normal((nb, bs, kvh, d)).astype(np.float32)
    v_cache = rng.standard_normal((nb, bs, kvh, d)).astype(np.float32)
    # Tile 0 starts a prompt; tile 1 follows it; tile 2 sits after a prefix of 29 (not on a
    # block) with 5 real rows and padding (position 0); tile 3 is padding only (zero table).
    positions = np.concatenate(
        [np.arange(0, 8), np.arange(8, 16), [*range(29, 34), 0, 0, 0], np.zeros(8)]
    ).astype(np.int32)
    tables[3] = 0
    live = np.r_[np.ones(21, bool), np.zeros(11, bool)]
    q = rng.standard_normal((4 * tile, hq, d)).astype(np.float32)
    got = cudnn_attention.prompt_attention(
        jnp.asarray(q, jnp.float32),
        jnp.asarray(k_cache),
        jnp.asarray(v_cache),
        jnp.asarray(tables),
        jnp.asarray(positions),
        tile=tile,
        scale=1 / np.sqrt(d),
    )
    got = np.asarray(got)
    want = _reference(q, k_cache, v_cache, tables, positions, tile, live)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[live], want[live], rtol=2e-5, atol=2e-5)
    assert not got[21:24].any() and not got[25:].any()  # padding rows past a run


def test_bad_shapes_are_refused(rng):
    q = jnp.zeros((24, 4, 16), jnp.bfloat16)
    cache = jnp.zeros((6, 4, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="bad shapes"):
        cudnn_attention.prompt_attention(
            q,
            cache,
            cache,
            jnp.zeros((2, 3), jnp.int32),
            jnp.zeros(24, jnp.int32),
            tile=8,
            scale=1.0,
        )


def test_cudnn_is_chosen_only_where_it_runs():
    assert resolve_implementation("auto", "cpu", jnp.bfloat16, 128, 4) == "xla"
    with pytest.raises(ValueError, match="'cudnn' cannot run"):
        resolve_implementation("cudnn", "cpu", jnp.bfloat16, 128, 4)
    assert "not on CUDA" in cudnn_attention.unavailable_reason("cpu", jnp.bfloat16, 128)
    assert "bfloat16 or float16" in cudnn_attention.unavailable_reason("gpu", jnp.float32, 128)
    assert "head_dim 96" not in (cudnn_attention.unavailable_reason("gpu", jnp.float16, 96) or "")
    assert "head_dim 100" in cudnn_attention.unavailable_reason("gpu", jnp.float16, 100)


@pytest.mark.parametrize("attention", ["cudnn", "xla"])
def test_warmup_runs_each_prompt_layout_once_on_cudnn(monkeypatch, attention):
    """XLA builds a cuDNN call's plan on its first run: with prompt tiles on cuDNN, warm-up
    runs each layout holding prompt rows once (padding rows), and no decode-only layout."""
    from flax import nnx

    from jax_tokenweave.models.configs import get_config
    from jax_tokenweave.models.llama import LlamaModel
    from jax_tokenweave.serving import EngineConfig, LLMEngine

    config = get_config("tiny")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    model = LlamaModel(config, mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
    cfg = EngineConfig(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        prefill_tile=16,
        block_size=8,
        num_blocks=32,
        max_model_len=48,
        compilation_cache_dir=None,
    )
    from jax_tokenweave.serving.runner import warmup

    engine = LLMEngine(model, cfg)
    runner = engine.runner
    ran = []
    monkeypatch.setattr(runner, "attention", lambda: attention)
    monkeypatch.setattr(runner, "run", lambda layout, arrays: ran.append(layout))
    layouts = runner.layouts()
    warmup._first_runs(runner, layouts)
    prompt = [la for la in layouts if la.rows > la.decode_rows]
    assert ran == (prompt if attention == "cudnn" else [])
    assert prompt and len(prompt) < len(layouts)


def test_a_changed_private_entry_is_refused_with_its_parameters(monkeypatch):
    """The module calls JAX's private cuDNN entry by keyword: a JAX whose entry takes other
    parameters makes the path unavailable (``auto`` then runs the CUDA kernels), not a crash."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    parameters = tuple(inspect.signature(fa._dot_product_attention_fwd).parameters)
    assert parameters[10:] == cudnn_attention.ENTRY_KEYWORDS and len(parameters) == 19
    monkeypatch.setattr(fa, "_dot_product_attention_fwd", lambda query, key, value: None)
    cudnn_attention._cudnn.cache_clear()
    try:
        why = cudnn_attention.unavailable_reason("gpu", jnp.bfloat16, 128)
    finally:
        cudnn_attention._cudnn.cache_clear()
    assert "has changed" in why and "'query', 'key', 'value'" in why
