"""RoPE + the paged-cache write in one CUDA kernel (``ffi/attention/rope_cache.cu``) against a
float64 reference and against the XLA path it replaces (``attention.apply_rope`` +
``paged_cache.write``): grouped-query heads, bf16 and fp16, positions up to 20k, slots in random
order, padding slots dropped, every other slot of the cache left untouched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpu_devices
from testutil import rel_err

from jax_tokenweave.config import RopeScaling
from jax_tokenweave.nn import attention as attn_lib
from jax_tokenweave.serving.attention import attention_kernel, paged_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not gpu_devices()
        or attention_kernel.unavailable_reason("gpu", jnp.bfloat16, 128, 4) is not None,
        reason="needs a GPU and the CUDA extension",
    ),
]


def _case(rng, rows, hq, kvh, d, dtype, num_blocks=64, bs=16, pad=None):
    qkv = jnp.asarray(rng.standard_normal((rows, hq + 2 * kvh, d)), dtype)
    positions = rng.integers(0, 20_000, rows).astype(np.int32)
    slots = rng.permutation(num_blocks * bs)[:rows].astype(np.int32)
    pad = rows // 4 if pad is None else pad
    slots[rng.permutation(rows)[:pad]] = num_blocks * bs + 5  # padding rows: dropped
    cache = [jnp.asarray(rng.standard_normal((num_blocks, bs, kvh, d)), dtype) for _ in range(2)]
    return qkv, positions, slots, cache


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    ("rows", "hq", "kvh", "d"), [(1, 32, 8, 128), (37, 8, 8, 64), (300, 16, 2, 128)]
)
def test_rope_cache_write_matches_reference_and_xla(rng, dtype, rows, hq, kvh, d):
    qkv, positions, slots, (k_cache, v_cache) = _case(rng, rows, hq, kvh, d, dtype)
    inv_freq = attn_lib.rope_inv_frequencies(d, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8192))
    k_before, v_before = np.asarray(k_cache), np.asarray(v_cache)
    fused = jax.jit(
        lambda x, p, s, k, v: attention_kernel.rope_cache_write(
            x, p, s, inv_freq, k, v, num_q_heads=hq
        )
    )
    q, k_out, v_out = fused(qkv, jnp.asarray(positions), jnp.asarray(slots), k_cache, v_cache)

    x = np.asarray(qkv.astype(jnp.float32), np.float64)
    q_ref = attn_lib.reference_rope(x[:, :hq], positions, inv_freq)
    k_ref = attn_lib.reference_rope(x[:, hq : hq + kvh], positions, inv_freq)
    tol = 1e-2 if dtype == jnp.bfloat16 else 2e-3
    assert rel_err(np.asarray(q.astype(jnp.float32)), q_ref) < tol
    bs = k_cache.shape[1]
    live = slots < k_cache.shape[0] * bs
    k_new = np.asarray(k_out.astype(jnp.float32)).reshape(-1, kvh, d)
    v_new = np.asarray(v_out).reshape(-1, kvh, d)
    assert rel_err(k_new[slots[live]], k_ref[live]) < tol
    np.testing.assert_array_equal(v_new[slots[live]], np.asarray(qkv)[live, hq + kvh :])
    untouched = np.setdiff1d(np.arange(k_new.shape[0]), slots[live])
    np.testing.assert_array_equal(
        np.asarray(k_out).reshape(-1, kvh, d)[untouched], k_before.reshape(-1, kvh, d)[untouched]
    )
    np.testing.assert_array_equal(v_new[untouched], v_before.reshape(-1, kvh, d)[untouched])

    def xla(x, p, s, k, v):  # the path it replaces
        qr = attn_lib.apply_rope(x[:, :hq], p, inv_freq)
        kr = attn_lib.apply_rope(x[:, hq : hq + kvh], p, inv_freq)
        return qr, paged_cache.write(k, s, kr), paged_cache.write(v, s, x[:, hq + kvh :])

    q_x, k_x, _ = jax.jit(xla)(
        qkv,
        jnp.asarray(positions),
        jnp.asarray(slots),
        jnp.asarray(k_before),
        jnp.asarray(v_before),
    )
    assert rel_err(np.asarray(q.astype(jnp.float32)), np.asarray(q_x.astype(jnp.float32))) < tol
    assert rel_err(np.asarray(k_out.astype(jnp.float32)), np.asarray(k_x.astype(jnp.float32))) < tol


def test_rope_cache_write_refuses_bad_shapes(rng):
    qkv, positions, slots, (k_cache, v_cache) = _case(rng, 4, 8, 2, 64, jnp.bfloat16, pad=0)
    inv_freq = attn_lib.rope_inv_frequencies(64, 10000.0)
    with pytest.raises(ValueError, match="query heads"):
        attention_kernel.rope_cache_write(
            qkv,
            jnp.asarray(positions),
            jnp.asarray(slots),
            inv_freq,
            k_cache,
            v_cache,
            num_q_heads=6,
        )
    with pytest.raises(ValueError, match="bad shapes"):
        attention_kernel.rope_cache_write(
            qkv,
            jnp.asarray(positions[:3]),
            jnp.asarray(slots),
            inv_freq,
            k_cache,
            v_cache,
            num_q_heads=8,
        )
