"""GPU tests of the copy-engine variant (``algo="ce"``) beyond the shared ones of
test_ffi_gpu.py (float64 reference, CTA counts, back-to-back calls, start/done): its rows equal
the SM variants' bit for bit, and a peer that never comes makes the one-warp wait give up past
the bound, with NaN outputs, a report naming the stage, and usable GPUs after."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ffi_gpu import EPS, _alone, _assert_fails_within_bound, _check, _inputs, _op, _shard

from jax_tokenweave.kernel import _ffi, ops
from jax_tokenweave.kernel.comm import CommSettings, Communicator

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


@pytest.mark.parametrize("tokens", [7, 1000, 4096])
def test_rows_equal_the_two_shot_kernels_bitwise(ffi_mesh2, rng, tokens):
    """The same sums in the same order, the same row split over 128 threads: the same bits."""
    args = _inputs(rng, 2, tokens, 8192, jnp.bfloat16)
    got = _op(ffi_mesh2, "ce", 16)(*args)
    want = _op(ffi_mesh2, "two_shot", 16)(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_slots_overlapped_many_times(ffi_mesh2, rng):
    """Two slots' calls in flight at once, start/done on one and sync on the other, 100 times:
    each slot's flags and staging areas stay its own."""
    pa, ra, w = _inputs(rng, 2, 3000, 8192, jnp.bfloat16)
    pb, rb, _ = _inputs(rng, 2, 1024, 8192, jnp.bfloat16)
    pa, pb = pa * 0.01, pb * 0.01
    kw = dict(axis_name="tp", mesh=ffi_mesh2, eps=EPS, algo="ce", num_ctas=16)

    def loop(pa, ra, pb, rb, w):
        def step(_, c):
            pend = _ffi.allreduce_rmsnorm_start(pa, c[1], w, slot=0, **kw)
            pend, x = jax.lax.optimization_barrier((pend, c[3]))
            b = _ffi.allreduce_rmsnorm(pb, x, w, slot=1, **kw)
            pend, b = jax.lax.optimization_barrier((pend, b))
            a = _ffi.allreduce_rmsnorm_done(pend, slot=0, axis_name="tp", mesh=ffi_mesh2)
            return (*a, *b)

        return jax.lax.fori_loop(0, 100, step, (jnp.zeros_like(pa), ra, jnp.zeros_like(pb), rb))

    got = _shard(ffi_mesh2, loop, 5, 4)(pa, ra, pb, rb, w)
    a, b = (None, ra), (None, rb)
    for _ in range(100):
        a = _op(ffi_mesh2, "ce", 16, 0)(pa, a[1], w)
        b = _op(ffi_mesh2, "ce", 16, 1)(pb, b[1], w)
    for g, want in zip(got, (*a, *b), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(want))


def test_forced_timeout_fails_the_call_within_the_bound(ffi_mesh2, rng):
    """Rank 1 never issues the call (launch gate off, so rank 0's kernels run): rank 0's wait
    gives up past the bound (1 s); the outputs are NaN, the report names the stage and the
    missing rank, later launches are refused, and both GPUs keep working."""
    settings = CommSettings(
        workspace_mib=64, ce_mib=64, num_slots=2, timeout_s=1.0, launch_gate=False
    )
    comm = Communicator(ffi_mesh2, "tp", settings)
    p, r, w = _inputs(rng, 1, 512, 4096, jnp.bfloat16)
    r = r[: ops.rows_per_rank(512, 2)]

    def body(p, r, w):
        return _ffi.allreduce_rmsnorm(p, r, w, axis_name="tp", comm=comm, algo="ce")

    step = _alone(ffi_mesh2, body)
    report = r"copy-engine reduce-scatter.*rank 1.*never started"
    _assert_fails_within_bound(ffi_mesh2, comm, step, (p, r, w), report, "wait expired")
    fresh = Communicator(ffi_mesh2, "tp", comm.settings)
    args = _inputs(rng, 2, 512, 4096, jnp.bfloat16)

    def both(p, r, w):
        return _ffi.allreduce_rmsnorm(p, r, w, axis_name="tp", comm=fresh, eps=EPS, algo="ce")

    _check(ffi_mesh2, _shard(ffi_mesh2, both, 3, 2)(*args), *args, jnp.bfloat16)
    comm.close()
    fresh.close()
