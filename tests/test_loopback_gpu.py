"""The fused kernels' protocol on one GPU: every rank of an N-rank group on the same device
(jax_tokenweave.kernel.loopback), for N in {1, 2, 4, 8}. Real kernels and device-resident state:
correctness against float64, bitwise agreement between ranks, calls, slots and graph replays,
and a forced timeout that leaves the CUDA context usable."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from testutil import rel_err

from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.kernel.comm import CommSettings
from jax_tokenweave.kernel.loopback import reference

pytestmark = pytest.mark.gpu

TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}
NP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def _inputs(rng, n, tokens, hidden, dtype):
    q = ceil_div(tokens, n)
    t = NP[dtype]
    partial = rng.standard_normal((n, tokens, hidden)).astype(t)
    residual = rng.standard_normal((n, q, hidden)).astype(t)
    weight = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    return partial, residual, weight


def _check(res, partial, residual, weight, dtype):
    assert res.error is None, res.error
    want_n, want_r = reference(partial, residual, weight)
    normed = res.normed.astype(np.float32)
    res_out = res.residual_out.astype(np.float32)
    assert np.isfinite(normed).all() and np.isfinite(res_out).all()  # every element written
    for r in range(1, normed.shape[0]):  # every rank holds the same normed rows, bitwise
        np.testing.assert_array_equal(normed[r], normed[0])
    assert rel_err(normed[0], want_n) < TOL[dtype]
    assert rel_err(res_out, want_r) < TOL[dtype]
    tokens = partial.shape[1]
    flat_res = residual.reshape(-1, residual.shape[-1])
    flat_out = res_out.reshape(-1, res_out.shape[-1])
    if flat_res.shape[0] > tokens:  # padding rows: the residual carried through exactly
        np.testing.assert_array_equal(flat_out[tokens:], flat_res[tokens:].astype(np.float32))


CASES = [
    (n, algo, dtype, tokens, hidden)
    for n in (1, 2, 4, 8)
    for algo in ("one_shot", "two_shot", "direct")
    for dtype, tokens, hidden in [
        ("bfloat16", 1, 8192),
        ("bfloat16", 77, 4096),
        ("float32", 3, 1024),
        ("float16", 16, 2048),
    ]
]


@pytest.mark.parametrize(("n", "algo", "dtype", "tokens", "hidden"), CASES)
def test_matches_float64_reference(loopback, rng, n, algo, dtype, tokens, hidden):
    comm = loopback.LoopbackComm(n)
    try:
        args = _inputs(rng, n, tokens, hidden, dtype)
        res = comm.run(*args, algo=algo, num_ctas=max(1, 32 // n), calls=3)
        _check(res, *args, dtype)
        assert res.mismatches == 0
    finally:
        comm.close()


def test_grid_beyond_what_one_gpu_holds_is_refused(loopback, rng):
    """Barrier kernels take up to 64 CTAs on GPUs of their own, but in the harness every rank's
    blocks share one GPU and must be resident at once: past 32 it refuses, naming the bound."""
    from jax_tokenweave.kernel import _extension

    top = _extension.limits()["max_loopback_ctas"]
    assert top < _extension.limits()["max_ctas"]
    comm = loopback.LoopbackComm(2)
    try:
        args = _inputs(rng, 2, 16, 4096, "bfloat16")
        with pytest.raises(RuntimeError, match=rf"num_ctas={top + 1} is outside \[1, {top}\]"):
            comm.run(*args, algo="two_shot", num_ctas=top + 1)
        _check(comm.run(*args, algo="two_shot", num_ctas=top), *args, "bfloat16")
    finally:
        comm.close()


@pytest.mark.parametrize("n", [2, 8])
def test_one_shot_large_and_uneven(loopback, rng, n):
    comm = loopback.LoopbackComm(n, CommSettings(workspace_mib=64, oneshot_mib=64, num_slots=1))
    try:
        args = _inputs(rng, n, 301, 8192, "bfloat16")  # q*N > T: padding rows on the last rank
        _check(comm.run(*args, algo="one_shot", num_ctas=8), *args, "bfloat16")
    finally:
        comm.close()


@pytest.mark.parametrize("algo", ["one_shot", "two_shot", "direct"])
def test_1000_calls_two_slots_and_graph_replays(loopback, rng, algo):
    comm = loopback.LoopbackComm(2)
    try:
        args = _inputs(rng, 2, 64, 4096, "bfloat16")
        res = comm.run(
            *args, algo=algo, num_ctas=8, calls=1000, slots=2, graph_calls=20, graph_replays=10
        )
        _check(res, *args, "bfloat16")
        assert res.mismatches == 0  # every call and every replay gave call 0's bits
        assert len(res.call_us) == 10 and all(t > 0 for t in res.call_us)
    finally:
        comm.close()


@pytest.mark.parametrize("algo", ["one_shot", "two_shot", "direct"])
@pytest.mark.parametrize(("n", "tokens", "ctas"), [(2, 1, 8), (8, 16, 8), (8, 16, 16), (4, 300, 8)])
def test_free_running_ranks_keep_every_call_exact(loopback, rng, algo, n, tokens, ctas):
    """Each rank's calls back to back on its own stream, forked and joined once per graph (as
    on GPUs of their own): a rank may run ahead of its peers, and every replayed call must
    still give call 0's bits. T = 300 at N = 4: uneven rows, the general one-shot kernel. N = 8
    with 16 CTAs: the decode kernel's blocks fill the GPU, so a next call's blocks launched too
    early (launch.cuh) would leave a peer without SMs and the wait would expire (seen after
    about a thousand calls, so each case runs 50 x 20)."""
    comm = loopback.LoopbackComm(n, CommSettings(workspace_mib=64, oneshot_mib=64, num_slots=1))
    try:
        args = _inputs(rng, n, tokens, 4096, "bfloat16")
        res = comm.run(
            *args, algo=algo, num_ctas=ctas, graph_calls=50, graph_replays=20, free_running=True
        )
        _check(res, *args, "bfloat16")
        assert res.mismatches == 0 and len(res.call_us) == 20
    finally:
        comm.close()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_decode_rows_kernel_and_general_one_shot_share_a_slot(loopback, rng, n):
    """The decode-size one-shot kernel (T <= CTAs) and the general one (T > CTAs) follow each
    other on one slot: same buffers, rotation and clearing; padding rows (T % N != 0) kept."""
    comm = loopback.LoopbackComm(n)
    try:
        for tokens, ctas in [(5, 8), (5, 2), (13, 16), (13, 4), (1, 1), (7, 16), (30, 8)]:
            args = _inputs(rng, n, tokens, 4096, "bfloat16")
            res = comm.run(*args, algo="one_shot", num_ctas=ctas, calls=3)
            _check(res, *args, "bfloat16")
            assert res.mismatches == 0, (tokens, ctas)
    finally:
        comm.close()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_decode_rows_cut_across_clusters_agree_with_a_block_per_row(loopback, rng, monkeypatch, n):
    """Decode-size rows cut across clusters of 2, 4 or 8 CTAs (sm_90; JAX_TOKENWEAVE_ROW_CTAS
    caps the cut, read at each launch) give a block per row's rows: the residual bitwise, the
    normed rows to the float32 rounding of a differently ordered sum of squares; calls and
    graph replays keep their bits, every rank the same. The cut takes at most the call's CTAs
    (128 / N here: every rank's blocks must be resident at once on one GPU)."""
    comm = loopback.LoopbackComm(n)
    try:
        for tokens in (1, 8, 16):
            args = _inputs(rng, n, tokens, 8192, "bfloat16")
            outs = {}
            for cap in (1, 2, 4, 8):
                monkeypatch.setenv("JAX_TOKENWEAVE_ROW_CTAS", str(cap))
                res = comm.run(
                    *args,
                    algo="one_shot",
                    num_ctas=128 // n,
                    calls=3,
                    graph_calls=4,
                    graph_replays=2,
                )
                _check(res, *args, "bfloat16")
                assert res.mismatches == 0, (tokens, cap)
                outs[cap] = res
            for cap, res in outs.items():
                np.testing.assert_array_equal(res.residual_out, outs[1].residual_out)
                got, want = (o.normed.astype(np.float32) for o in (res, outs[1]))
                assert rel_err(got, want) < 2e-3, (tokens, cap)
    finally:
        comm.close()


def test_algos_share_a_slot(loopback, rng):
    """The device epoch and the one-shot rotation survive other variants on the same slot."""
    comm = loopback.LoopbackComm(4)
    try:
        args = _inputs(rng, 4, 40, 2048, "bfloat16")
        first = comm.run(*args, algo="one_shot", calls=5)
        for algo in ("direct", "one_shot", "two_shot", "one_shot", "one_shot"):
            res = comm.run(*args, algo=algo, calls=4)
            _check(res, *args, "bfloat16")
            np.testing.assert_array_equal(res.normed, first.normed)
    finally:
        comm.close()


# one_shot at 16 tokens on 16 CTAs runs the decode-size kernel (a row per block), on 8 the
# general one.
@pytest.mark.parametrize(("algo", "num_ctas"), [("one_shot", 8), ("one_shot", 16), ("direct", 8)])
def test_forced_timeout_is_reported_and_leaves_the_context_usable(loopback, rng, algo, num_ctas):
    comm = loopback.LoopbackComm(
        2, CommSettings(workspace_mib=64, oneshot_mib=4, num_slots=2, timeout_s=0.5)
    )
    args = _inputs(rng, 2, 16, 2048, "bfloat16")
    res = comm.run(*args, algo=algo, num_ctas=num_ctas, calls=6, skip_call=3, skip_rank=1)
    assert res.error is not None and "rank 1" in res.error and "expired" in res.error
    assert "never started this call" in res.error  # told apart from a stalled kernel
    # the rank that waited leaves NaN, not data (rank 1 still holds its call-2 outputs)
    assert np.isnan(res.normed[0].astype(np.float32)).all()
    assert np.isnan(res.residual_out[0].astype(np.float32)).all()
    again = comm.run(*args, algo=algo, calls=1)  # sticky: refused before any launch
    assert again.error == res.error
    comm.close()
    x = jnp.arange(1024.0, device=jax.devices("gpu")[0])  # the context still works
    assert float(jnp.sum(x * 2)) == 1024.0 * 1023.0
    fresh = loopback.LoopbackComm(2)
    try:
        _check(fresh.run(*args, algo=algo), *args, "bfloat16")
    finally:
        fresh.close()


_PROBE = textwrap.dedent("""
    import json, sys
    from jax_tokenweave.kernel import _extension
    from jax_tokenweave.kernel.comm import CommSettings
    from jax_tokenweave.kernel.loopback import LoopbackComm
    comm = LoopbackComm(2, CommSettings(workspace_mib=16, oneshot_mib=1, num_slots=1,
                                        timeout_s=3.0))
    print(json.dumps(_extension.get().lazy_load_probe(comm.comm_id, sys.argv[1] == "1")),
          flush=True)
""")


@pytest.mark.parametrize("preload", [False, True])
def test_lazy_loading_behind_a_spinning_kernel(loopback, preload):
    """The timeout root cause under test: with CUDA's lazy loading a kernel's first launch may
    wait until the device idles, i.e. behind a fused kernel spinning for a peer. The extension
    preloads its kernels; this measures both cases in fresh processes (printed) and requires
    that a preloaded kernel launches at once."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, "1" if preload else "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    launch_s, done_s, spin_s = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"preload={preload}: launch {launch_s:.3f} s, probe done {done_s:.3f} s, "
        f"spinner ended {spin_s:.3f} s"
    )
    if preload:
        assert launch_s < 0.5 and done_s < 0.5  # ran beside the spinning kernel
    assert spin_s > 2.0  # the spinner did wait for its bound (3 s from ~0.2 s before)
