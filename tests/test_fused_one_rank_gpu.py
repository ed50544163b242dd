"""The fused call on a one-GPU axis (N = 1, ``ffi/collective/local_rows.cu``): nothing to
communicate, so it is add + RMSNorm with no sync state. Against a float64 reference at decode and
prefill sizes, rows past the register budget (float32 H = 16384), the start/done pair, a long chain
of calls, and XLA's own add + RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpu_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from testutil import rel_err

from jax_tokenweave.kernel import _ffi, ops

pytestmark = pytest.mark.gpu
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}
EPS = 1e-6


@pytest.fixture(scope="module")
def mesh1() -> Mesh:
    if not gpu_devices():
        pytest.skip("needs a GPU")
    mesh = Mesh(np.array(gpu_devices()[:1]), ("tp",))
    why = _ffi.unavailable_reason(mesh, "tp", jnp.bfloat16, (1, 4096))
    if why is not None:
        pytest.skip(why)
    return mesh


def _call(mesh, calls=1, start_done=False, algo="auto"):
    def body(p, r, w):
        for _ in range(calls):  # each call's normed output is the next call's partial
            if start_done:
                pending = _ffi.allreduce_rmsnorm_start(p, r, w, axis_name="tp", mesh=mesh, eps=EPS)
                p, r = _ffi.allreduce_rmsnorm_done(pending, axis_name="tp", mesh=mesh)
            else:
                p, r = _ffi.allreduce_rmsnorm(
                    p, r, w, axis_name="tp", mesh=mesh, eps=EPS, algo=algo
                )
        return p, r

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("tp"), P("tp"), P()),
            out_specs=(P("tp"), P("tp")),
            check_vma=False,
        )
    )


def _inputs(rng, tokens, hidden, dtype):
    partial = rng.standard_normal((tokens, hidden)).astype(np.float32)
    residual = rng.standard_normal((tokens, hidden)).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    return (jnp.asarray(partial, dtype), jnp.asarray(residual, dtype), jnp.asarray(weight))


def _reference(partial, residual, weight, calls=1):
    p, r, w = (
        np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (partial, residual, weight)
    )
    for _ in range(calls):
        r = p + r
        p = r / np.sqrt((r * r).mean(-1, keepdims=True) + EPS) * w
    return p, r


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize(
    ("tokens", "hidden"), [(1, 8192), (7, 4096), (64, 8192), (256, 8192), (5000, 4096), (3, 16384)]
)
def test_one_rank_call_matches_float64(mesh1, rng, tokens, hidden, dtype):
    args = _inputs(rng, tokens, hidden, dtype)
    normed, res_out = (np.asarray(o.astype(jnp.float32)) for o in _call(mesh1)(*args))
    want_n, want_r = _reference(*args)
    assert np.isfinite(normed).all() and np.isfinite(res_out).all()
    assert rel_err(normed, want_n) < TOL[dtype]
    assert rel_err(res_out, want_r) < TOL[dtype]


@pytest.mark.parametrize("algo", ["one_shot", "two_shot", "direct"])
def test_every_algo_takes_the_one_rank_kernel(mesh1, rng, algo):
    """Whatever variant is asked for, a group of one gives the same rows, bitwise."""
    args = _inputs(rng, 16, 8192, jnp.bfloat16)
    want = [np.asarray(o) for o in _call(mesh1)(*args)]
    got = [np.asarray(o) for o in _call(mesh1, algo=algo)(*args)]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_start_done_and_a_chain_of_calls(mesh1, rng):
    args = _inputs(rng, 33, 4096, jnp.float32)
    want_n, want_r = _reference(*args, calls=200)
    for start_done in (False, True):
        normed, res_out = (np.asarray(o) for o in _call(mesh1, 200, start_done)(*args))
        assert rel_err(normed, want_n) < 1e-4 and rel_err(res_out, want_r) < 1e-4


def test_matches_xla_add_rmsnorm(mesh1, rng):
    """Same rounding as XLA's add + RMSNorm (the sum rounded to bf16, then normed in float32),
    with a bf16 weight (no float32 copy of it)."""
    p, r, w = _inputs(rng, 64, 8192, jnp.bfloat16)
    args = (p, r, w.astype(jnp.bfloat16))  # the weight in the rows' dtype: read as it is
    got = _call(mesh1)(*args)
    want = jax.jit(lambda p, r, w: ops.add_rmsnorm(p, r, w, EPS))(*args)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert (
        rel_err(np.asarray(got[0].astype(jnp.float32)), np.asarray(want[0].astype(jnp.float32)))
        < 4e-3
    )


@pytest.mark.parametrize(
    ("tokens", "hidden", "dtype"),
    [
        (1, 8192, jnp.bfloat16),
        (16, 8192, jnp.bfloat16),
        (24, 8192, jnp.bfloat16),
        (64, 8192, jnp.bfloat16),
        (48, 5120, jnp.float16),
        (40, 4096, jnp.float32),
        (5, 4096, jnp.float16),
        (3, 16384, jnp.float32),
    ],
)
def test_rows_cut_across_a_cluster_agree(mesh1, rng, monkeypatch, tokens, hidden, dtype):
    """Rows cut across clusters of 2, 4 or 8 CTAs (sm_90, up to 16 rows, capped by
    JAX_TOKENWEAVE_ROW_CTAS) give the one-block rows: the rounded sums bitwise, the
    normed rows to the float32 rounding of a differently ordered sum of squares. Past 16 rows
    a row held by a pair of CTAs (each summing its squares as one block does) gives them
    bitwise."""
    args = _inputs(rng, tokens, hidden, dtype)
    want_n, want_r = _reference(*args)
    outs = {}
    for cap in (1, 2, 4, 8):
        monkeypatch.setenv("JAX_TOKENWEAVE_ROW_CTAS", str(cap))
        outs[cap] = [np.asarray(o.astype(jnp.float32)) for o in _call(mesh1)(*args)]
    for cap, (normed, res_out) in outs.items():
        assert np.isfinite(normed).all(), cap
        assert rel_err(normed, want_n) < TOL[dtype] and rel_err(res_out, want_r) < TOL[dtype]
        np.testing.assert_array_equal(res_out, outs[1][1])
        assert rel_err(normed, outs[1][0]) < (1e-6 if dtype == jnp.float32 else 2e-3), cap
        if tokens > 16:  # no cluster: a pair of CTAs a row, or a block per row
            np.testing.assert_array_equal(normed, outs[1][0])
