"""Whole decode batches with a replicated residual: ``ffi`` and ``auto`` resolve to
``ffi-replicated`` where the kernel takes the layout and its policy runs one-shot (CPU), and on
two GPUs the model agrees with the token-sharded call and with baseline."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from testutil import GPU_CONFIG, build_decoder, rel_err, run_calls

from jax_tokenweave.kernel import _ffi
from jax_tokenweave.kernel.comm import Communicator
from jax_tokenweave.models.configs import get_config
from jax_tokenweave.weave import reducers
from jax_tokenweave.weave.plan import plan_batch
from jax_tokenweave.weave.schedules import configure, resolve_collective


def test_whole_decode_batches_take_the_replicated_residual(cpu_mesh, monkeypatch):
    """``ffi`` and ``auto`` on a whole batch resolve to ``ffi-replicated`` where the kernel takes
    the replicated layout and its policy runs one-shot for the size; otherwise token-sharded."""
    mesh, hidden = cpu_mesh(2), get_config("tiny").hidden_size
    split, whole = plan_batch((5, 9), split=True), plan_batch((5, 9), split=False)
    ctx = reducers.ReduceContext("tp", mesh, 1e-6)
    assert type(configure("weave", "ffi-replicated", whole)[1](ctx)) is reducers.Replicated
    with pytest.raises(ValueError, match="whole batch"):
        configure("weave", "ffi-replicated", split)
    with pytest.raises(RuntimeError, match="collective='ffi-replicated' is unavailable"):
        resolve_collective("ffi-replicated", mesh, "tp", jnp.float32, whole, hidden)  # CPU
    monkeypatch.setattr(_ffi, "unavailable_reason", lambda *a, **k: None)
    monkeypatch.setattr(_ffi, "replicated_reason", lambda *a, **k: None)
    resolve = lambda c, b: resolve_collective(c, mesh, "tp", jnp.float32, b, hidden)
    assert [resolve(c, whole) for c in ("auto", "ffi", "ffi-sync", "ffi-replicated")] == [
        "ffi-replicated",
        "ffi-replicated",
        "ffi-sync",
        "ffi-replicated",
    ]
    assert resolve("ffi", split) == "ffi"
    with pytest.raises(RuntimeError, match="needs a whole batch"):
        resolve("ffi-replicated", split)
    # where the policy runs another variant for the size, the token-sharded call stays
    monkeypatch.setattr(Communicator, "choose", lambda self, *a, **k: ("direct", 32))
    assert resolve("auto", whole) == "ffi" and resolve("ffi-replicated", whole) == "ffi-replicated"
    # and where the kernel refuses the replicated layout
    monkeypatch.setattr(_ffi, "replicated_reason", lambda *a, **k: "rows over 16 KiB")
    assert resolve("ffi", whole) == "ffi"
    with pytest.raises(RuntimeError, match="rows over 16 KiB"):
        resolve("ffi-replicated", whole)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_gpu_decode_batch_with_a_replicated_residual(ffi_mesh2, rng):
    """A whole decode batch: ``ffi`` runs the replicated-residual kernel, and agrees with the
    token-sharded call (``ffi-sync``) and with baseline."""
    mesh = ffi_mesh2
    config = get_config("tiny", **GPU_CONFIG)
    batch = plan_batch((1,) * 16, tp=2, split=False)
    hidden_size = config.hidden_size
    assert resolve_collective("ffi", mesh, "tp", jnp.bfloat16, batch, hidden_size) == (
        "ffi-replicated"
    )
    dec = build_decoder(config, mesh, jnp.bfloat16, rng)
    hidden = jnp.asarray(rng.standard_normal((batch.num_tokens, hidden_size)), jnp.bfloat16)
    rep, sharded, base = run_calls(
        dec,
        batch,
        hidden,
        [
            dict(schedule="weave", collective="ffi"),
            dict(schedule="weave", collective="ffi-sync"),
            dict(schedule="baseline"),
        ],
        jit_opts=False,
    )
    assert np.isfinite(np.asarray(rep, np.float32)).all()
    assert rel_err(rep, base) < 2e-2 and rel_err(rep, sharded) < 2e-2
