"""``ops.allreduce_rmsnorm`` against a float64 NumPy reference on virtual CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from testutil import rel_err

from jax_tokenweave.kernel import ops

EPS = 1e-5
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def run(mesh, partials, residual, weight, impl, eps=EPS, **kwargs):
    """partials: [N, T, H] (rank r's partial = partials[r]); residual: global (replicated for
    ``xla``, [N*q, H] token-sharded otherwise)."""
    res_spec = P() if impl in ("xla", "ffi_replicated") else P("tp")

    def f(p, r, w):
        return ops.allreduce_rmsnorm(
            p[0], r, w, axis_name="tp", eps=eps, impl=impl, mesh=mesh, **kwargs
        )

    fn = jax.jit(
        jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(P("tp"), res_spec, P()),
            out_specs=(P(), res_spec),
            check_vma=False,
        )
    )
    return fn(partials, residual, weight)


def reference(partials, residual_rows, weight, eps=EPS):
    summed = np.asarray(partials, np.float64).sum(0) + np.asarray(residual_rows, np.float64)
    normed = (
        summed
        / np.sqrt(np.mean(summed**2, -1, keepdims=True) + eps)
        * np.asarray(weight, np.float64)
    )
    return normed, summed


def make_inputs(rng, n, t, h, dtype, impl):
    partials = jnp.asarray(rng.standard_normal((n, t, h)), dtype)
    weight = jnp.asarray(1 + 0.1 * rng.standard_normal(h), dtype)
    rows = ops.residual_rows(t, n, impl)
    copies = 1 if impl in ("xla", "ffi_replicated") else n
    residual = jnp.asarray(rng.standard_normal((rows * copies, h)), dtype)
    return partials, residual, weight


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["xla", "xla_rsag", "auto"])
@pytest.mark.parametrize(
    ("tp", "tokens"), [(2, 1), (2, 7), (4, 3), (4, 16), (8, 1), (8, 13), (8, 37)]
)
def test_matches_reference(cpu_mesh, rng, tp, tokens, impl, dtype):
    mesh, h = cpu_mesh(tp), 32
    partials, residual, weight = make_inputs(rng, tp, tokens, h, dtype, impl)
    normed, res_out = run(mesh, partials, residual, weight, impl)
    assert normed.shape == (tokens, h) and normed.dtype == dtype
    assert res_out.shape == residual.shape and res_out.dtype == dtype
    want_normed, want_sum = reference(partials, np.asarray(residual, np.float64)[:tokens], weight)
    assert rel_err(normed, want_normed) < TOL[dtype]
    assert rel_err(np.asarray(res_out, np.float64)[:tokens], want_sum) < TOL[dtype]
    # padding rows of a token-sharded residual are carried through unchanged
    np.testing.assert_array_equal(np.asarray(res_out)[tokens:], np.asarray(residual)[tokens:])


def test_residual_rows():
    assert ops.rows_per_rank(13, 8) == 2
    assert ops.residual_rows(13, 8, "xla") == 13
    assert ops.residual_rows(13, 8, "xla_rsag") == 2
    assert ops.residual_rows(16, 4, "auto") == 4
    assert ops.residual_rows(13, 8, "ffi_replicated") == 13
    with pytest.raises(ValueError):
        ops.rows_per_rank(0, 4)
    with pytest.raises(ValueError, match="impl"):
        ops.residual_rows(4, 2, "nccl")


@pytest.mark.parametrize("impl", ["ffi", "ffi_replicated"])
def test_ffi_unavailable_on_cpu(cpu_mesh, rng, impl):
    mesh = cpu_mesh(2)
    partials, residual, weight = make_inputs(rng, 2, 4, 16, jnp.float32, impl)
    with pytest.raises(RuntimeError, match=rf"impl='{impl}'\) is unavailable"):
        run(mesh, partials, residual, weight, impl)


def test_auto_falls_back_to_xla_rsag(cpu_mesh, rng):
    mesh = cpu_mesh(4)
    partials, residual, weight = make_inputs(rng, 4, 9, 16, jnp.float32, "auto")
    got = run(mesh, partials, residual, weight, "auto")
    want = run(mesh, partials, residual, weight, "xla_rsag")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("impl", ["xla", "xla_rsag"])
def test_bad_inputs(cpu_mesh, rng, impl):
    mesh, n, t, h = cpu_mesh(2), 2, 5, 16
    partials, residual, weight = make_inputs(rng, n, t, h, jnp.float32, impl)
    with pytest.raises(ValueError, match="weight"):  # weight of the wrong width
        run(mesh, partials, residual, jnp.ones(h + 2, jnp.float32), impl)
    with pytest.raises(ValueError, match="residual"):  # residual of the wrong width
        run(mesh, partials, residual[:, :8], weight, impl)
    with pytest.raises(ValueError, match="residual"):  # wrong number of residual rows
        run(mesh, partials, jnp.zeros((residual.shape[0] + n, h), jnp.float32), weight, impl)
    with pytest.raises(ValueError, match="dtype"):  # residual dtype differs
        run(mesh, partials, residual.astype(jnp.bfloat16), weight, impl)
    with pytest.raises(ValueError, match="floating"):  # integer partial sums
        run(mesh, partials.astype(jnp.int32), residual.astype(jnp.int32), weight, impl)
    with pytest.raises(ValueError, match="empty"):  # no tokens
        run(mesh, partials[:, :0], residual[:0], weight, impl)


def test_bad_impl_name(cpu_mesh, rng):
    mesh = cpu_mesh(2)
    partials, residual, weight = make_inputs(rng, 2, 4, 16, jnp.float32, "xla")
    with pytest.raises(ValueError, match="impl must be one of"):
        run(mesh, partials, residual, weight, "nccl")


def test_partial_must_be_2d(cpu_mesh, rng):
    mesh = cpu_mesh(2)
    partials, residual, weight = make_inputs(rng, 2, 4, 16, jnp.float32, "xla")

    def f(p, r, w):
        return ops.allreduce_rmsnorm(p, r, w, axis_name="tp", impl="xla")

    fn = jax.shard_map(
        f, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(), P()), check_vma=False
    )
    with pytest.raises(ValueError, match="tokens, hidden"):
        fn(partials, residual, weight)


def test_rms_norm_math():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
    got = np.asarray(ops.rms_norm(jnp.asarray(x), jnp.asarray([1.0, 2.0]), 0.0))
    np.testing.assert_allclose(got[0], [3 / np.sqrt(12.5), 8 / np.sqrt(12.5)], rtol=1e-6)
    normed, summed = ops.add_rmsnorm(jnp.ones((1, 2)), jnp.ones((1, 2)), jnp.ones(2), 0.0)
    np.testing.assert_allclose(np.asarray(summed), [[2.0, 2.0]])
    np.testing.assert_allclose(np.asarray(normed), [[1.0, 1.0]], rtol=1e-6)
