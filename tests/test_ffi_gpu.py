"""GPU tests of the fused kernel (skipped without at least two peer GPUs)."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from testutil import rel_err

from jax_tokenweave.kernel import _ffi, ops

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-5}
EPS = 1e-6


# Jitted functions live for the whole module: freeing one unloads its executable's CUDA
# modules, which may happen when its last call ends, while later calls are in flight (see
# ffi_mesh2 in conftest.py and ffi/README.md, "One process, several GPUs").
_KEEP_ALIVE: list = []


def _shard(mesh, fn, n_in, n_out):
    f = jax.jit(
        jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=(P("tp"),) * (n_in - 1) + (P(),),
            out_specs=(P("tp"),) * n_out,
            check_vma=False,
        )
    )
    _KEEP_ALIVE.append(f)
    return f


def _alone(mesh2, body):
    """``body(partial, residual, weight)`` jitted on the first GPU of ``mesh2`` alone (a rank
    whose peer never issues the call), every input and output replicated."""
    from jax.sharding import Mesh

    alone = Mesh(mesh2.devices[:1], ("tp",))
    spec = dict(in_specs=(P(), P(), P()), out_specs=(P(), P()), check_vma=False)
    return jax.jit(jax.shard_map(body, mesh=alone, **spec))


def _assert_gpus_work(mesh):
    """Every GPU of ``mesh`` still runs a computation (no CUDA context was lost)."""
    for d in mesh.devices.flat:
        assert float(jnp.sum(jax.device_put(jnp.arange(8.0), d))) == 28.0


def _assert_fails_within_bound(mesh, comm, step, args, report, refusal):
    """``step(*args)`` (a 1 s bound) gives up in 1-10 s with NaN in both outputs;
    ``comm.check()`` raises ``CommFailed`` matching ``report``, a rerun raises matching
    ``refusal``, and every GPU of ``mesh`` still works."""
    from jax_tokenweave.kernel.comm import CommFailed

    start = time.perf_counter()
    normed, res = jax.block_until_ready(step(*args))
    seconds = time.perf_counter() - start
    assert 1.0 <= seconds < 10.0, seconds
    assert np.isnan(np.asarray(normed.astype(jnp.float32))).all()
    assert np.isnan(np.asarray(res.astype(jnp.float32))).all()
    with pytest.raises(CommFailed, match=report):
        comm.check()
    with pytest.raises(Exception, match=refusal):
        jax.block_until_ready(step(*args))
    _assert_gpus_work(mesh)  # the CUDA contexts survived


def _inputs(rng, n, tokens, hidden, dtype):
    rows = ops.rows_per_rank(tokens, n)
    partial = rng.standard_normal((n * tokens, hidden)).astype(np.float32)
    residual = rng.standard_normal((n * rows, hidden)).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    return (jnp.asarray(partial, dtype), jnp.asarray(residual, dtype), jnp.asarray(weight, dtype))


def _reference(partial, residual, weight, n):
    p = np.asarray(partial, np.float64)
    r = np.asarray(residual, np.float64)
    tokens = p.shape[0] // n
    rows = r.shape[0] // n
    summed = p.reshape(n, tokens, -1).sum(0)
    res_out = r.copy()
    padded = np.zeros((n * rows, p.shape[1]))
    padded[:tokens] = summed
    res_out += padded
    x = res_out[:tokens]
    normed = x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * np.asarray(weight, np.float64)
    return normed, res_out


def _poison(mesh, shapes_dtypes):
    """Fill freed device memory with NaN so unwritten outputs would show."""
    for shape, dtype in shapes_dtypes:
        for d in mesh.devices.flat:
            jax.device_put(jnp.full((4 * shape[0], *shape[1:]), jnp.nan, dtype), d).delete()


def _check(mesh, outs, partial, residual, weight, dtype):
    n = mesh.shape["tp"]
    normed, res_out = (np.asarray(o.astype(jnp.float32)) for o in outs)
    want_n, want_r = _reference(partial, residual, weight, n)
    tokens = partial.shape[0] // n
    assert np.isfinite(normed).all() and np.isfinite(res_out).all()
    copies = normed.reshape(n, tokens, -1)
    for c in copies[1:]:  # every rank holds the same normed rows, bitwise
        np.testing.assert_array_equal(c, copies[0])
    assert rel_err(copies[0], want_n) < TOL[dtype]
    assert rel_err(res_out, want_r) < TOL[dtype]
    pad = want_r.shape[0] - tokens  # padding rows: residual carried through exactly
    if pad:
        np.testing.assert_array_equal(
            res_out[tokens:], np.asarray(residual.astype(jnp.float32))[tokens:]
        )


@functools.cache
def _op(mesh, algo, num_ctas=16, slot=0):
    def body(p, r, w):
        return _ffi.allreduce_rmsnorm(
            p, r, w, axis_name="tp", mesh=mesh, eps=EPS, slot=slot, num_ctas=num_ctas, algo=algo
        )

    return _shard(mesh, body, 3, 2)


CASES = [
    (t, h, d)
    for d in (jnp.bfloat16, jnp.float32)
    for h in (4096, 8192)
    for t in (1, 3, 16, 128, 1024, 4096)
] + [(t, 4096, jnp.float16) for t in (3, 1024)]


@pytest.mark.parametrize("algo", ["two_shot", "one_shot", "direct", "ce"])
@pytest.mark.parametrize(("tokens", "hidden", "dtype"), CASES)
def test_matches_float64_reference(ffi_mesh2, rng, tokens, hidden, dtype, algo):
    why = _ffi.unavailable_reason(ffi_mesh2, "tp", dtype, (tokens, hidden), algo=algo)
    if why is not None:
        pytest.skip(why)  # a one-shot message larger than its receive buffer
    args = _inputs(rng, 2, tokens, hidden, dtype)
    _poison(ffi_mesh2, [((tokens, hidden), dtype)])
    outs = _op(ffi_mesh2, algo)(*args)
    _check(ffi_mesh2, outs, *args, dtype)


@pytest.mark.parametrize("algo", ["auto", "two_shot", "direct", "ce"])
@pytest.mark.parametrize("num_ctas", [1, 8, 32, 64])
def test_num_ctas(ffi_mesh2, rng, num_ctas, algo):
    args = _inputs(rng, 2, 333, 4096, jnp.bfloat16)
    _check(ffi_mesh2, _op(ffi_mesh2, algo, num_ctas)(*args), *args, jnp.bfloat16)


@pytest.mark.parametrize("tokens", [1, 64, 256, 1024, 4096])
def test_policy_choices_match_float64_reference(ffi_mesh2, rng, tokens):
    """The shipped policy's variant and CTA count per size (num_ctas None), at H = 8192."""
    args = _inputs(rng, 2, tokens, 8192, jnp.bfloat16)
    _poison(ffi_mesh2, [((tokens, 8192), jnp.bfloat16)])
    _check(ffi_mesh2, _op(ffi_mesh2, "auto", None)(*args), *args, jnp.bfloat16)


def test_ops_ffi_and_auto_match_xla_rsag(ffi_mesh2, rng):
    args = _inputs(rng, 2, 100, 4096, jnp.bfloat16)
    res = {}
    for impl in ("ffi", "auto", "xla_rsag"):

        def body(p, r, w, impl=impl):
            return ops.allreduce_rmsnorm(
                p, r, w, axis_name="tp", impl=impl, mesh=ffi_mesh2, eps=EPS
            )

        res[impl] = _shard(ffi_mesh2, body, 3, 2)(*args)
    for impl in ("ffi", "auto"):
        for g, w in zip(res[impl], res["xla_rsag"], strict=True):
            assert rel_err(g, w) < 1e-2
    np.testing.assert_array_equal(np.asarray(res["ffi"][0]), np.asarray(res["auto"][0]))


@pytest.mark.parametrize(
    ("tokens", "algo"), [(1024, "two_shot"), (16, "one_shot"), (1024, "direct"), (1024, "ce")]
)
def test_1000_back_to_back_calls(ffi_mesh2, rng, tokens, algo):
    iters = 1000
    p, r, w = _inputs(rng, 2, tokens, 4096, jnp.bfloat16)
    p = p * 0.01  # the residual grows by the sum each step

    def chain(p, r, w):
        def step(_, carry):
            return _ffi.allreduce_rmsnorm(  # the configuration of `single` below: a row's
                p, carry[1], w, axis_name="tp", mesh=ffi_mesh2, eps=EPS, algo=algo, num_ctas=16
            )  # sum of squares is cut across CTAs by the count, so bits follow it

        return jax.lax.fori_loop(0, iters, step, (jnp.zeros_like(p), r))

    got = _shard(ffi_mesh2, chain, 3, 2)(p, r, w)
    single = _op(ffi_mesh2, algo)
    carry = (None, r)
    for _ in range(iters):
        carry = single(p, carry[1], w)
    for g, want in zip(got, carry, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(want))


def test_two_slots_interleaved(ffi_mesh2, rng):
    iters = 100
    pa, ra, w = _inputs(rng, 2, 1000, 8192, jnp.bfloat16)
    pb, rb, _ = _inputs(rng, 2, 77, 8192, jnp.bfloat16)
    pa, pb = pa * 0.01, pb * 0.01

    def both(pa, ra, pb, rb, w):
        def step(_, c):
            kw = dict(axis_name="tp", mesh=ffi_mesh2, eps=EPS, num_ctas=16)  # as _op below
            a = _ffi.allreduce_rmsnorm(pa, c[1], w, slot=0, **kw)
            b = _ffi.allreduce_rmsnorm(pb, c[3], w, slot=1, **kw)
            return (*a, *b)

        return jax.lax.fori_loop(0, iters, step, (jnp.zeros_like(pa), ra, jnp.zeros_like(pb), rb))

    got = _shard(ffi_mesh2, both, 5, 4)(pa, ra, pb, rb, w)
    a, b = (None, ra), (None, rb)
    for _ in range(iters):
        a = _op(ffi_mesh2, "auto", 16, 0)(pa, a[1], w)
        b = _op(ffi_mesh2, "auto", 16, 1)(pb, b[1], w)
    for g, want in zip(got, (*a, *b), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(want))
    _check(ffi_mesh2, _op(ffi_mesh2, "auto", 16, 1)(pb, rb, w), pb, rb, w, jnp.bfloat16)


@pytest.mark.parametrize("algo", ["auto", "two_shot", "direct", "ce"])
def test_start_done_matches_sync(ffi_mesh2, rng, algo):
    pa, ra, w = _inputs(rng, 2, 2000, 8192, jnp.bfloat16)
    pb, rb, _ = _inputs(rng, 2, 500, 8192, jnp.bfloat16)
    kw = dict(axis_name="tp", mesh=ffi_mesh2, eps=EPS, algo=algo, num_ctas=16)  # as _op's

    def overlapped(pa, ra, pb, rb, w):
        pend = _ffi.allreduce_rmsnorm_start(pa, ra, w, slot=2, **kw)
        pend, pb = jax.lax.optimization_barrier((pend, pb))
        b = _ffi.allreduce_rmsnorm(pb * 2, rb, w, slot=3, **kw)  # on XLA's stream meanwhile
        pend, b = jax.lax.optimization_barrier((pend, b))
        a = _ffi.allreduce_rmsnorm_done(pend, slot=2, axis_name="tp", mesh=ffi_mesh2)
        return (*a, *b)  # (the start's algo applies to b too: both run `algo`)

    got = _shard(ffi_mesh2, overlapped, 5, 4)(pa, ra, pb, rb, w)
    _check(ffi_mesh2, got[:2], pa, ra, w, jnp.bfloat16)
    _check(ffi_mesh2, got[2:], pb * 2, rb, w, jnp.bfloat16)
    want = _op(ffi_mesh2, algo, 16, 0)(pa, ra, w)
    for g, x in zip(got[:2], want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(x))

    def chain(pa, ra, w):
        def step(_, c):
            pend = _ffi.allreduce_rmsnorm_start(pa, c[1], w, slot=2, **kw)
            return _ffi.allreduce_rmsnorm_done(pend, slot=2, axis_name="tp", mesh=ffi_mesh2)

        return jax.lax.fori_loop(0, 200, step, (jnp.zeros_like(pa), ra))

    pa = pa * 0.01
    got = _shard(ffi_mesh2, chain, 3, 2)(pa, ra, w)
    c = (None, ra)
    for _ in range(200):
        c = _op(ffi_mesh2, algo, 16, 0)(pa, c[1], w)
    for g, x in zip(got, c, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(x))


def test_errors(ffi_mesh2, rng, monkeypatch):
    args = _inputs(rng, 2, 16, 4096, jnp.bfloat16)

    def body(p, r, w, num_ctas=1000, algo="auto"):
        kw = dict(axis_name="tp", mesh=ffi_mesh2, num_ctas=num_ctas, algo=algo)
        return _ffi.allreduce_rmsnorm(p, r, w, **kw)

    with pytest.raises(ValueError, match="num_ctas"):  # beyond every variant's grid
        _shard(ffi_mesh2, body, 3, 2)(*args)
    two_shot_65 = functools.partial(body, num_ctas=65, algo="two_shot")  # one-shot only
    with pytest.raises(RuntimeError, match="num_ctas=65 is outside"):
        _shard(ffi_mesh2, two_shot_65, 3, 2)(*args)
    monkeypatch.setenv("JAX_TOKENWEAVE_WORKSPACE_MB", "16")
    monkeypatch.setenv("JAX_TOKENWEAVE_ALGO", "two_shot")  # direct stages nothing
    why = _ffi.unavailable_reason(ffi_mesh2, "tp", jnp.bfloat16, (4096, 8192))
    assert why is not None and "workspace_mib" in why
    big = _inputs(rng, 2, 4096, 8192, jnp.bfloat16)

    def body2(p, r, w):
        return ops.allreduce_rmsnorm(p, r, w, axis_name="tp", impl="ffi", mesh=ffi_mesh2)

    with pytest.raises(RuntimeError, match="workspace"):
        _shard(ffi_mesh2, body2, 3, 2)(*big)


def test_under_shard_map_with_check_vma(ffi_mesh2, rng):
    args = _inputs(rng, 2, 64, 4096, jnp.bfloat16)

    def body(p, r, w):
        return ops.allreduce_rmsnorm(p, r, w, axis_name="tp", impl="ffi", mesh=ffi_mesh2, eps=EPS)

    f = jax.jit(
        jax.shard_map(
            body, mesh=ffi_mesh2, in_specs=(P("tp"), P("tp"), P()), out_specs=(P("tp"), P("tp"))
        )
    )
    _check(ffi_mesh2, f(*args), *args, jnp.bfloat16)


def test_forced_timeout_raises_and_leaves_the_gpus_usable(ffi_mesh2, rng):
    """Rank 1 never issues the call (the step runs on GPU 0 alone, with a communicator of both
    GPUs; launch gate off, so rank 0's kernel runs): rank 0's wait expires, the kernel returns
    NaN, the next call raises the recorded error, and both GPUs keep working."""
    from jax_tokenweave.kernel.comm import CommFailed, CommSettings, Communicator

    settings = CommSettings(
        workspace_mib=64, oneshot_mib=4, num_slots=2, timeout_s=1.0, launch_gate=False
    )
    comm = Communicator(ffi_mesh2, "tp", settings)
    p, r, w = _inputs(rng, 1, 16, 4096, jnp.bfloat16)
    r = r[: ops.rows_per_rank(16, 2)]  # the residual rows rank 0 owns in a group of two

    def body(p, r, w):
        return _ffi.allreduce_rmsnorm(p, r, w, axis_name="tp", comm=comm, algo="one_shot")

    step = _alone(ffi_mesh2, body)
    normed, _ = step(p, r, w)
    assert np.isnan(np.asarray(normed.astype(jnp.float32))).all()
    issued = r"issued 0 launches on slot 0 to the missing rank \(device \d+\) and 1 to the waiting"
    with pytest.raises(CommFailed, match=r"rank 1.*never started.*" + issued):
        comm.check()  # the host never issued rank 1's call: its count says so
    with pytest.raises(Exception, match="wait expired"):
        jax.block_until_ready(step(p, r, w))
    _assert_gpus_work(ffi_mesh2)  # the CUDA contexts survived
    fresh = Communicator(ffi_mesh2, "tp", comm.settings)
    args = _inputs(rng, 2, 16, 4096, jnp.bfloat16)

    def both(p, r, w):
        return _ffi.allreduce_rmsnorm(p, r, w, axis_name="tp", comm=fresh, eps=EPS)

    _check(ffi_mesh2, _shard(ffi_mesh2, both, 3, 2)(*args), *args, jnp.bfloat16)
    comm.close()  # the failed workspace is freed; a call compiled with it now refuses
    with pytest.raises(Exception, match="unknown comm id"):
        jax.block_until_ready(step(p, r, w))


@pytest.mark.parametrize("start", [False, True], ids=["sync", "start"])
def test_launch_gate_fails_the_call_when_a_local_gpu_never_arrives(ffi_mesh2, rng, start):
    """One process, two GPUs, rank 1's host never reaches the call (a start, or the uncaptured
    sync call): rank 0 launches nothing of it, waits at the launch gate for the bound (1 s),
    then reports (stage "launch gate", the late rank and its count) and leaves NaN; later calls
    are refused; the GPUs keep working."""
    from jax_tokenweave.kernel.comm import CommSettings, Communicator

    settings = CommSettings(workspace_mib=64, oneshot_mib=4, ce_mib=64, num_slots=2, timeout_s=1.0)
    comm = Communicator(ffi_mesh2, "tp", settings)
    p, r, w = _inputs(rng, 1, 64, 4096, jnp.bfloat16)
    r = r[: ops.rows_per_rank(64, 2)]

    def body(p, r, w):
        if not start:  # the gated sync call: the copy-engine one (never in a command buffer)
            return _ffi.allreduce_rmsnorm(p, r, w, axis_name="tp", comm=comm, algo="ce")
        pending = _ffi.allreduce_rmsnorm_start(p, r, w, axis_name="tp", comm=comm, algo="two_shot")
        return _ffi.allreduce_rmsnorm_done(pending, axis_name="tp", comm=comm)

    step = _alone(ffi_mesh2, body)
    report = r"launch gate expired.*rank 1 .*call 1 .*reached 0"
    _assert_fails_within_bound(ffi_mesh2, comm, step, (p, r, w), report, "launch gate expired")
    comm.close()
