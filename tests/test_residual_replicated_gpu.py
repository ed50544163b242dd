"""The fused call with a replicated residual ([T, H] on every rank, ``residual_replicated``): the
decode one-shot kernel exchanges partial rows only. On one GPU through the loopback harness
(N in {2, 4, 8}) and through JAX on a one- and a two-GPU axis: float64 agreement, every rank's
rows bitwise the same and bitwise the token-sharded call's, calls and graph replays exact, the
two layouts taking turns on one slot, and refusals that name the bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import gpu_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from testutil import rel_err

from jax_tokenweave.kernel import _ffi, ops
from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.kernel.loopback import reference

pytestmark = pytest.mark.gpu
EPS = 1e-6


def _inputs(rng, n, tokens, hidden):
    """partial [N, T, H], the residual both ways (replicated [N, T, H], every rank's copy the
    same; token-sharded [N, q, H] of the same rows, zero padding), weight [H] float32."""
    bf16 = ml_dtypes.bfloat16
    partial = rng.standard_normal((n, tokens, hidden)).astype(bf16)
    rows = rng.standard_normal((tokens, hidden)).astype(bf16)
    sharded = np.zeros((n * ceil_div(tokens, n), hidden), bf16)
    sharded[:tokens] = rows
    weight = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    replicated = np.repeat(rows[None], n, axis=0)
    return partial, replicated, sharded.reshape(n, -1, hidden), weight


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 7, 16])
def test_loopback_matches_float64_and_the_token_sharded_call(loopback, rng, n, tokens):
    comm = loopback.LoopbackComm(n)
    try:
        partial, replicated, sharded, weight = _inputs(rng, n, tokens, 8192)
        for ctas in sorted({16, 128 // n}):  # rows cut across as many CTAs as these allow
            rep = comm.run(
                partial,
                replicated,
                weight,
                num_ctas=ctas,
                calls=3,
                graph_calls=8,
                graph_replays=2,
                free_running=True,
                residual_replicated=True,
            )
            assert rep.error is None and rep.mismatches == 0, (ctas, rep.error)
            want_n, want_r = reference(partial, replicated, weight, residual_replicated=True)
            normed = rep.normed.astype(np.float32)
            res_out = rep.residual_out.astype(np.float32)
            assert res_out.shape == (n, tokens, 8192)
            for r in range(n):  # every rank's rows, bitwise the same
                np.testing.assert_array_equal(normed[r], normed[0])
                np.testing.assert_array_equal(res_out[r], res_out[0])
            assert rel_err(normed[0], want_n) < 1e-2 and rel_err(res_out, want_r) < 1e-2
            shd = comm.run(partial, sharded, weight, num_ctas=ctas, calls=3)
            assert shd.error is None and shd.mismatches == 0
            np.testing.assert_array_equal(rep.normed, shd.normed)  # same adds, same order
            flat = shd.residual_out.reshape(-1, 8192)[:tokens]
            np.testing.assert_array_equal(rep.residual_out[0], flat)
    finally:
        comm.close()


def test_loopback_layouts_take_turns_on_one_slot(loopback, rng):
    """A replicated call sends fewer bytes than a token-sharded one, so the buffer each clears
    for the next differs; alternating them on one slot keeps every call exact."""
    comm = loopback.LoopbackComm(4)
    try:
        partial, replicated, sharded, weight = _inputs(rng, 4, 13, 4096)
        first = comm.run(partial, sharded, weight, num_ctas=16, calls=2)
        for replicated_now in (True, False, True, True, False):
            res = comm.run(
                partial,
                replicated if replicated_now else sharded,
                weight,
                num_ctas=16,
                calls=4,
                residual_replicated=replicated_now,
            )
            assert res.error is None and res.mismatches == 0
            np.testing.assert_array_equal(res.normed, first.normed)
    finally:
        comm.close()


def test_loopback_refuses_what_the_decode_kernel_cannot_take(loopback, rng):
    comm = loopback.LoopbackComm(2)
    try:
        partial, replicated, _, weight = _inputs(rng, 2, 16, 4096)
        for kwargs in (dict(num_ctas=8), dict(num_ctas=16, algo="two_shot")):
            with pytest.raises(RuntimeError, match="replicated residual needs the decode"):
                comm.run(partial, replicated, weight, residual_replicated=True, **kwargs)
        with pytest.raises(ValueError, match=r"replicated residual must be \(2, 16, 4096\)"):
            comm.run(partial, replicated[:, :8], weight, num_ctas=16, residual_replicated=True)
    finally:
        comm.close()


def _op(mesh, impl):
    def body(p, r, w):
        return ops.allreduce_rmsnorm(p[0], r, w, axis_name="tp", impl=impl, mesh=mesh, eps=EPS)

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("tp"), P(), P()),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )


@pytest.mark.parametrize("axis", [1, 2])
@pytest.mark.parametrize("tokens", [1, 16, 32])
def test_op_matches_xla_with_the_same_layout(rng, axis, tokens):
    """``impl="ffi_replicated"`` against ``impl="xla"`` (psum, then add + RMSNorm): the same
    replicated residual in and out, on a one-GPU axis (the one-rank kernel) and a two-GPU one."""
    if len(gpu_devices()) < axis:
        pytest.skip(f"needs {axis} GPUs")
    mesh = Mesh(np.array(gpu_devices()[:axis]), ("tp",))
    if (why := _ffi.unavailable_reason(mesh, "tp", jnp.bfloat16, (tokens, 4096))) is not None:
        pytest.skip(why)
    partial = jnp.asarray(rng.standard_normal((axis, tokens, 4096)), jnp.bfloat16)
    residual = jnp.asarray(rng.standard_normal((tokens, 4096)), jnp.bfloat16)
    weight = jnp.asarray(1 + 0.1 * rng.standard_normal(4096), jnp.float32)
    got = _op(mesh, "ffi_replicated")(partial, residual, weight)
    want = _op(mesh, "xla")(partial, residual, weight)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (tokens, 4096) and g.dtype == jnp.bfloat16
        assert rel_err(np.asarray(g, np.float32), np.asarray(w, np.float32)) < 1e-2
    text = _op(mesh, "ffi_replicated").lower(partial, residual, weight).as_text()
    assert "tokenweave_allreduce_rmsnorm" in text and "all_reduce" not in text
