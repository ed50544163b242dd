"""RoPE (incl. Llama-3 scaling) and ragged causal attention vs dense masked references."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testutil import rel_err

from jax_tokenweave.config import RopeScaling
from jax_tokenweave.nn import attention as A
from jax_tokenweave.weave.plan import Piece, plan_batch


def qkv(rng, t, nq, nkv, d, dtype=jnp.float32):
    return tuple(jnp.asarray(rng.standard_normal((t, n, d)), dtype) for n in (nq, nkv, nkv))


def attend_plan(plan, q, k, v, **kwargs):
    """Run ragged_attention half by half, passing earlier halves' K/V as the prefix."""
    outs = []
    for j, half in enumerate(plan.halves):
        prefix = {}
        for piece in half.pieces:
            if piece.position:
                assert j > 0
                lo = piece.start - piece.position
                prefix[piece.request] = (k[lo : piece.start], v[lo : piece.start])
        sl = slice(half.start, half.end)
        outs.append(
            A.ragged_attention(
                q[sl], k[sl], v[sl], half.pieces, origin=half.start, prefix=prefix, **kwargs
            )
        )
    return jnp.concatenate(outs)


@pytest.mark.parametrize(
    ("lengths", "threshold"),
    [
        ((7,), 10**6),  # one request, no split
        ((4, 4, 4, 5), 10**6),  # equal lengths batched together by a reshape
        ((3, 5, 3, 2, 3), 10**6),  # equal lengths that are not adjacent (stacked)
        ((5, 9, 3), 4),  # split; request 1 is cut, its 2nd piece has a prefix
        ((30,), 2),  # a single request cut in two
        ((6, 10), 2),  # split point exactly at the request boundary
    ],
)
@pytest.mark.parametrize(("nq", "nkv"), [(4, 4), (4, 2), (2, 1)])
def test_ragged_matches_dense_reference(rng, lengths, threshold, nq, nkv):
    plan = plan_batch(lengths, threshold=threshold)
    q, k, v = qkv(rng, plan.num_tokens, nq, nkv, 8)
    got = jax.jit(lambda q, k, v: attend_plan(plan, q, k, v))(q, k, v)
    want = A.reference_attention(q, k, v, lengths)
    assert got.shape == q.shape
    assert rel_err(got, want) < 1e-5


def test_cut_request_really_has_prefix():
    plan = plan_batch((5, 9, 3), threshold=4)
    assert plan.cut_request == 1
    assert plan.halves[1].pieces[0].position > 0


def test_ragged_bf16_under_jit(rng):
    plan = plan_batch((5, 9, 3, 3), threshold=4)
    q, k, v = qkv(rng, plan.num_tokens, 4, 2, 16, jnp.bfloat16)
    got = jax.jit(lambda q, k, v: attend_plan(plan, q, k, v))(q, k, v)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, A.reference_attention(q, k, v, plan.request_lengths)) < 2e-2


def test_prefix_errors(rng):
    q, k, v = qkv(rng, 4, 2, 2, 8)
    piece = (Piece(request=0, start=10, length=4, position=3),)
    with pytest.raises(ValueError, match="prefix"):
        A.ragged_attention(q, k, v, piece, origin=10)
    with pytest.raises(ValueError, match="prefix"):
        A.ragged_attention(q, k, v, piece, origin=10, prefix={0: (k[:2], v[:2])})
    good = A.ragged_attention(q, k, v, piece, origin=10, prefix={0: (k[:3], v[:3])})
    assert good.shape == q.shape


def test_piece_coverage_errors(rng):
    q, k, v = qkv(rng, 6, 2, 2, 8)
    with pytest.raises(ValueError, match="cover"):
        A.ragged_attention(q, k, v, (Piece(0, 0, 4, 0),))
    with pytest.raises(ValueError, match="contiguous"):
        A.ragged_attention(q, k, v, (Piece(0, 0, 3, 0), Piece(1, 4, 2, 0)))
    with pytest.raises(ValueError, match="multiple"):
        A.ragged_attention(q[:, :1], k[:, :2], v[:, :2], (Piece(0, 0, 6, 0),))


def test_causal_mask_bottom_right():
    mask = A.causal_mask(2, 5)
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(A.causal_mask(3, 3), np.tril(np.ones((3, 3), bool)))


def test_default_implementation(monkeypatch):
    monkeypatch.delenv(A.IMPL_ENV, raising=False)
    assert A.default_implementation("gpu", jnp.bfloat16, 128) == "cudnn"
    assert A.default_implementation("gpu", jnp.float32, 128) is None
    assert A.default_implementation("cpu", jnp.bfloat16, 128) is None
    monkeypatch.setenv(A.IMPL_ENV, "xla")
    assert A.default_implementation("gpu", jnp.bfloat16, 128) is None
    monkeypatch.setenv(A.IMPL_ENV, "flash")
    with pytest.raises(ValueError, match=A.IMPL_ENV):
        A.default_implementation("gpu", jnp.bfloat16, 128)


def test_cudnn_request_falls_back_off_gpu(rng):
    plan = plan_batch((3, 5), threshold=4)
    q, k, v = qkv(rng, plan.num_tokens, 2, 2, 8)
    got = attend_plan(plan, q, k, v, implementation="cudnn")
    assert rel_err(got, A.reference_attention(q, k, v, plan.request_lengths)) < 1e-5


# ---------------------------------------------------------------------------------- RoPE ----


def test_rope_plain_frequencies():
    inv = A.rope_inv_frequencies(8, 10000.0)
    np.testing.assert_allclose(inv, [1.0, 10000**-0.25, 10000**-0.5, 10000**-0.75])


def test_rope_llama3_scaling_regimes():
    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    plain = A.rope_inv_frequencies(128, 500000.0)
    scaled = A.rope_inv_frequencies(128, 500000.0, scaling)
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    medium = ~high & ~low
    assert high.any() and low.any() and medium.any()
    np.testing.assert_allclose(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8)
    smooth = (8192 / wavelen[medium] - 1) / (4 - 1)
    np.testing.assert_allclose(
        scaled[medium], (1 - smooth) * plain[medium] / 8 + smooth * plain[medium]
    )
    assert np.all(scaled[medium] < plain[medium]) and np.all(scaled[medium] > plain[medium] / 8)


def test_apply_rope_matches_reference_and_is_relative(rng):
    inv = A.rope_inv_frequencies(16, 500000.0, RopeScaling())
    x = rng.standard_normal((5, 3, 16))
    pos = np.array([0, 1, 7, 100, 5000])
    got = A.apply_rope(jnp.asarray(x, jnp.float32), pos, inv)
    want = A.reference_rope(x, pos, inv)
    assert rel_err(got, want) < 1e-5
    np.testing.assert_allclose(np.linalg.norm(want, axis=-1), np.linalg.norm(x, axis=-1))
    np.testing.assert_allclose(want[0], x[0])  # position 0 is the identity
    # <rope(q, m), rope(k, n)> depends on m - n only
    q, k = rng.standard_normal((1, 1, 16)), rng.standard_normal((1, 1, 16))
    dot = lambda m, n: float(np.sum(A.reference_rope(q, [m], inv) * A.reference_rope(k, [n], inv)))
    assert dot(10, 3) == pytest.approx(dot(107, 100), rel=1e-9)


def test_rope_bad_head_dim():
    with pytest.raises(ValueError):
        A.rope_inv_frequencies(7, 10000.0)
