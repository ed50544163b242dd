"""One long request cut by the split (the ISO case): the work model that places the split, and
the outputs of a split placed by it (== the unsplit baseline and the float64 reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from testutil import FakeKernel, build_decoder, rel_err

from jax_tokenweave.models.configs import get_config
from jax_tokenweave.nn.params import logical_weights
from jax_tokenweave.reference.model import reference_decoder
from jax_tokenweave.weave.cost import CostModel
from jax_tokenweave.weave.plan import WaveModel, plan_batch


def test_half_costs_by_hand():
    model = CostModel(gemm_flops_per_token=10.0, attention_flops_per_pair=1.0, tile_m=1)
    # one request of 4 tokens cut after 2: A has 2 tokens, 3 causal pairs; B has 2 tokens that
    # see A's 2 keys and 3 pairs among themselves: 7 pairs.
    assert model.half_costs([4], 2) == (20 + 3, 20 + 7)
    # two requests [3, 2] cut after 3: nothing crosses the cut.
    assert model.half_costs([3, 2], 3) == (30 + 6, 20 + 3)
    assert model.piece_cost(2, 2) == 20 + 7
    with pytest.raises(ValueError):
        CostModel(0.0, 1.0)
    with pytest.raises(ValueError, match="at least 2"):
        model.balanced_split([1])


def test_llama_flops_per_token():
    c = get_config("llama3-70b")
    model = CostModel.from_config(c, 2)
    h, f, q, kv = 8192, 28672, 64 * 128, 8 * 128
    want = (2 * h * (q + 2 * kv) + 2 * q * h + 2 * h * 2 * f + 2 * f * h) / 2
    assert model.gemm_flops_per_token == want
    assert model.attention_flops_per_pair == 4 * q / 2
    m = get_config("mixtral-8x22b")
    moe = CostModel.from_config(m, 2)
    dense = CostModel.from_config(get_config("mixtral-8x22b", num_experts=0), 2)
    mlp, router = 6 * m.hidden_size * m.intermediate_size / 2, 2 * m.hidden_size * 8
    # dense dispatch: every token through all 8 experts, plus the router
    assert moe.gemm_flops_per_token == pytest.approx(dense.gemm_flops_per_token + 7 * mlp + router)


def test_one_16384_token_request_balances_work_not_tokens():
    """Llama-3-70B shapes, TP 2, one request of 16384 tokens: at the token midpoint the second
    half (which also attends to the first half's keys) has ~15% more work; the balanced split
    gives the first half more tokens, stays on a tile multiple, and evens the work out."""
    config = get_config("llama3-70b", num_layers=8)
    model = CostModel.from_config(config, 2)
    a_mid, b_mid = model.half_costs([16384], 8192)
    assert b_mid / a_mid > 1.1
    first = model.balanced_split([16384], waves=WaveModel.from_config(config, 2))
    assert first > 8192 and first % 128 == 0
    a, b = model.half_costs([16384], first)
    assert abs(a - b) / max(a, b) < 0.02
    # each neighbouring tile multiple leaves a larger bottleneck
    for other in (first - 128, first + 128):
        assert max(model.half_costs([16384], other)) >= max(a, b)
    plan = plan_batch([16384], tp=2, config=config)
    assert plan.is_split and plan.half_lengths == (first, 16384 - first) and plan.cut_request == 0
    # many short requests: the work balances at the midpoint, as before
    assert plan_batch([1024] * 16, tp=2, config=config).half_lengths == (8192, 8192)


@pytest.mark.parametrize(("tp", "dtype"), [(2, jnp.float32), (4, jnp.float32), (2, jnp.bfloat16)])
def test_long_request_split_matches_unsplit(cpu_mesh, rng, tp, dtype):
    """A single long request split at the work-balanced point (tile 16): weave (xla, and the
    overlapped schedule with the kernel stand-ins) equals the unsplit baseline and the float64
    reference."""
    config, mesh = get_config("tiny"), cpu_mesh(tp)
    length = int(rng.integers(200, 320))
    cost = CostModel.from_config(config, tp, tile_m=16)
    plan = plan_batch([length], tp=tp, config=config, split=True, cost=cost)
    first = plan.halves[0].length
    assert plan.cut_request == 0 and first > length // 2 and first % 16 == 0
    dec = build_decoder(config, mesh, dtype, rng)
    hidden = jnp.asarray(rng.standard_normal((length, config.hidden_size)), dtype)
    want = reference_decoder(
        logical_weights(dec), config, np.asarray(hidden, np.float64), (length,)
    )
    fake = FakeKernel()
    graphdef, state = nnx.split(dec)

    def run(state, hidden):
        model = nnx.merge(graphdef, state)
        return (
            model(hidden, plan, schedule="weave", collective="xla"),
            model(hidden, plan, schedule="weave", collective="ffi", reducer=fake.overlap),
            model(hidden, plan, schedule="baseline"),
        )

    weave, overlap, base = jax.jit(run)(state, hidden)
    fake.check_protocol()
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for out in (weave, overlap, base):
        assert rel_err(out, want) < tol
    assert rel_err(weave, base) < tol and rel_err(overlap, base) < tol
