"""CPU tests of the copy-engine variant's host logic (``algo="ce"``): the stream plan each rank
issues (ffi/collective/ce_plan.h), simulated across ranks and calls with random interleavings, and
the settings and sizes the Python side checks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_tokenweave.kernel import _extension
from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.kernel.comm import CommSettings, choose, shape_reason
from jax_tokenweave.kernel.policy import KernelPolicy, PolicyRow

needs_ext = pytest.mark.skipif(
    _extension.import_error() is not None,
    reason=f"extension not built: {_extension.import_error()}",
)


def _plan(rank, n, tokens, rb):
    ops = _extension.get().ce_plan(rank, n, tokens, rb)
    keys = ("kind", "peer", "phase", "src", "dst", "bytes")
    return [dict(zip(keys, op, strict=True)) for op in ops]


@needs_ext
@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("tokens", [1, 5, 64, 1000])
def test_plan_moves_every_row_once_to_where_the_kernels_read_it(n, tokens):
    """Scatter copies fill each owner's peer slices with exactly the rows the reduce kernel
    reads (slice PeerIndex(src, owner), row by row); gather copies fill every other owner's
    rows of `normed` from that owner's own slice (N-1); nothing lands outside the staging
    area (CopyEngineBytes) or twice."""
    rb = 48
    q = ceil_div(tokens, n)
    area = _extension.get().needed_bytes("ce", n, tokens, rb // 2, 2)
    assert area == n * q * rb
    staging = {j: {} for j in range(n)}  # owner -> byte offset -> (src rank, token row)
    normed = {r: {} for r in range(n)}  # rank -> token row -> owner it came from
    for r in range(n):
        for op in _plan(r, n, tokens, rb):
            if op["kind"] == "scatter_copy":
                j = op["peer"]
                assert op["src"] % rb == 0 and op["dst"] % rb == 0 and op["bytes"] % rb == 0
                assert op["dst"] >= 0 and op["dst"] + op["bytes"] <= (n - 1) * q * rb
                for i in range(op["bytes"] // rb):
                    off = op["dst"] + i * rb
                    assert off not in staging[j], "two copies land on one row"
                    staging[j][off] = (r, op["src"] // rb + i)
            elif op["kind"] == "gather_copy":
                j = op["peer"]
                assert op["src"] == (n - 1) * q * rb  # the owner's own (normed) slice
                for i in range(op["bytes"] // rb):
                    row = op["dst"] // rb + i
                    assert row not in normed[r]
                    normed[r][row] = j
    for owner in range(n):
        want = {}
        for src in range(n):
            if src == owner:
                continue
            peer_index = (src - owner + n) % n - 1
            for row in range(q):
                if owner * q + row < tokens:
                    want[(peer_index * q + row) * rb] = (src, owner * q + row)
        assert staging[owner] == want
    for r in range(n):
        want = {t: t // q for t in range(tokens) if t // q != r}
        assert normed[r] == want


def _simulate(n, tokens, calls, seed):
    """Runs every rank's plan `calls` times, one op at a time in a random order, as streams
    would: a wait blocks until its flag is set, then clears it. Checks that no signal finds
    its flag still set (it would be lost), that a peer pushes call k+1's rows only after the
    owner's reduce of call k read them, and that an owner's reduce of call k+1 overwrites its
    slice only after every peer pulled call k's. Returns the op count run."""
    rng = np.random.default_rng(seed)
    plans = [_plan(r, n, tokens, 16) for r in range(n)]
    flags = np.zeros((n, 2, n), bool)  # [receiver, phase, sender]
    pc = [0] * n  # op index per rank, over all calls
    reduces = np.zeros(n, int)  # reduce kernels done per rank
    pulls = np.zeros((n, n), int)  # [puller, owner]: gather copies done
    pushes = np.zeros((n, n), int)  # [pusher, owner]: scatter copies done
    total = sum(len(p) for p in plans) * calls
    ran = 0
    while ran < total:
        ready = []
        for r in range(n):
            if pc[r] >= len(plans[r]) * calls:
                continue
            op = plans[r][pc[r] % len(plans[r])]
            others = [j for j in range(n) if j != r]
            if op["kind"] == "wait" and not flags[r, op["phase"], others].all():
                continue
            ready.append(r)
        assert ready, f"deadlock at {pc}"
        r = int(rng.choice(ready))
        call = pc[r] // len(plans[r])
        op = plans[r][pc[r] % len(plans[r])]
        kind, j = op["kind"], op["peer"]
        if kind == "scatter_copy":
            assert reduces[j] >= call, "pushed into a slice the owner has not reduced yet"
            pushes[r, j] += 1
        elif kind == "signal":
            assert not flags[j, op["phase"], r], "a signal found its flag still set"
            flags[j, op["phase"], r] = True
        elif kind == "wait":  # every peer's flag of the phase, then cleared
            assert j == -1
            flags[r, op["phase"], :] = False
        elif kind == "reduce":
            for src in range(n):  # every peer's rows of this call are in, none of the next
                if src != r and ceil_div(tokens, n) * r < tokens:
                    assert pushes[src, r] == call + 1
            for peer in range(n):  # every peer pulled our previous call's slice
                if peer != r and ceil_div(tokens, n) * r < tokens:
                    assert pulls[peer, r] == call
            reduces[r] += 1
        elif kind == "gather_copy":
            assert reduces[j] == call + 1, "pulled a slice of another call"
            pulls[r, j] += 1
        pc[r] += 1
        ran += 1
    assert not flags.any()  # every flag cleared by its reader
    return ran


@needs_ext
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("tokens", [3, 100])
def test_plan_is_deadlock_free_and_orders_the_staging_areas(n, tokens, rng):
    for seed in rng.integers(0, 2**31, size=8):
        assert _simulate(n, tokens, calls=4, seed=int(seed)) > 0


@needs_ext
def test_plan_order():
    """Copies, signals and one wait per phase around the reduce; the finish kernel last."""
    kinds = [op["kind"] for op in _plan(1, 4, 64, 32)]
    assert kinds == (
        ["scatter_copy"] * 3
        + ["signal"] * 3
        + ["wait", "reduce"]
        + ["signal"] * 3
        + ["wait"]
        + ["gather_copy"] * 3
        + ["finish"]
    )
    with pytest.raises(ValueError):
        _extension.get().ce_plan(4, 4, 64, 32)  # rank out of range


def test_settings_size_the_copy_engine_area(monkeypatch):
    monkeypatch.setenv("JAX_TOKENWEAVE_CE_MB", "64")
    s = CommSettings.from_env(num_slots=4)
    assert s.ce_mib == 64 and s.ce_bytes == 16 * 2**20
    with pytest.raises(ValueError, match="ce_mib"):
        CommSettings(ce_mib=-1)


@needs_ext
def test_shape_reason_and_choose_for_ce():
    small = CommSettings(ce_mib=4, num_slots=4)  # 1 MiB a slot
    why = shape_reason(2, jnp.bfloat16, (128, 8192), small, algo="ce")
    assert why is not None and "ce_mib" in why and "copy-engine" in why
    assert shape_reason(2, jnp.bfloat16, (64, 8192), small, algo="ce") is None  # exactly 1 MiB
    lim = _extension.limits()
    assert lim["algos"]["ce"] == 4 and lim["max_ce_ctas"] >= lim["max_ctas"]
    s = CommSettings()
    top = lim["max_ce_ctas"]
    assert shape_reason(2, jnp.bfloat16, (4096, 8192), s, algo="ce", num_ctas=top) is None
    assert "num_ctas" in shape_reason(2, jnp.bfloat16, (4096, 8192), s, algo="ce", num_ctas=top + 1)
    why = shape_reason(2, jnp.bfloat16, (16, 8192), s, algo="ce", residual_replicated=True)
    assert why is not None and "replicated" in why
    policy = KernelPolicy({2: (PolicyRow(1 << 20, "one_shot", 64), PolicyRow(None, "ce", 132))})
    assert choose(2, jnp.bfloat16, (8192, 8192), s, policy=policy) == ("ce", 132)
    assert choose(2, jnp.bfloat16, (16, 8192), s, policy=policy) == ("one_shot", 64)
    # a ce row's CTA count is capped where another variant is forced
    assert choose(2, jnp.bfloat16, (8192, 8192), s, algo="direct", policy=policy)[1] <= 64
