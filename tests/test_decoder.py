"""``WeaveDecoder``: weave == baseline == a float64 single-device reference; input checks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from testutil import FakeKernel, rel_err
from testutil import build_decoder as build

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.models.configs import get_config
from jax_tokenweave.nn import attention as A
from jax_tokenweave.nn.decoder import WeaveDecoder
from jax_tokenweave.nn.params import logical_weights, named_params
from jax_tokenweave.reference.model import reference_decoder
from jax_tokenweave.weave.plan import plan_batch

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def forward(dec, batch, schedules=(("weave", "xla"), ("baseline", "xla")), return_kv=False):
    """Compile once: the decoder under each (schedule, comm) on the same input.

    XLA's CPU backend optimisation is turned off: it only saves compile time here.
    """
    graphdef, state = nnx.split(dec)

    def run(state, hidden):
        model = nnx.merge(graphdef, state)
        return [
            model(hidden, batch, schedule=s, collective=c, return_kv=return_kv)
            for s, c in schedules
        ]

    cache = {}

    def call(hidden):
        key = (hidden.shape, hidden.dtype)
        if key not in cache:
            cache[key] = (
                jax.jit(run)
                .lower(state, hidden)
                .compile(compiler_options={"xla_backend_optimization_level": 0})
            )
        return cache[key](state, hidden)

    return call


def _slow(*args):
    return pytest.param(*args, marks=pytest.mark.slow)


CASES = [
    # (config, tp, request lengths, split threshold, dtype); the fast run keeps 8 of 12
    ("tiny", 2, (5,), 1024, jnp.float32),  # below the threshold: one half
    _slow("tiny", 8, (1,), 1024, jnp.float32),  # one token, fewer than TP
    ("tiny", 4, (5, 9, 3), 4, jnp.float32),  # split, request 1 straddles it
    ("tiny", 8, (3, 11, 7, 2), 8, jnp.float32),  # T=23: not divisible by TP
    _slow("tiny", 8, (100, 130, 70), 256, jnp.float32),  # T=300 > 256, midpoint rule
    _slow("tiny", 2, (5, 9, 3), 4, jnp.bfloat16),
    ("tiny", 4, (5, 9, 3), 4, jnp.bfloat16),
    _slow("tiny", 4, (7, 6), 1024, jnp.bfloat16),  # bf16 below the threshold
    ("tiny", 8, (2, 19), 8, jnp.bfloat16),
    ("tiny-moe", 8, (4, 9, 6), 8, jnp.float32),
    ("tiny-qwen", 2, (6, 7, 4), 8, jnp.float32),
    ("tiny-qwen", 8, (6, 7, 4), 8, jnp.bfloat16),
]


@pytest.mark.parametrize(("name", "tp", "lengths", "threshold", "dtype"), CASES)
def test_weave_baseline_reference(cpu_mesh, rng, name, tp, lengths, threshold, dtype):
    config, mesh = get_config(name), cpu_mesh(tp)
    batch = plan_batch(lengths, tp=tp, threshold=threshold)
    dec = build(config, mesh, dtype, rng)
    hidden = jnp.asarray(rng.standard_normal((batch.num_tokens, config.hidden_size)), dtype)
    want = reference_decoder(logical_weights(dec), config, np.asarray(hidden, np.float64), lengths)
    schedules = (("weave", "xla"), ("baseline", "xla"))
    if tp == 8 and dtype == jnp.float32 and name == "tiny":
        schedules += (("weave", "auto"),)  # auto = xla_rsag on CPU
    outs = forward(dec, batch, schedules)(hidden)
    for out in outs:
        assert out.shape == hidden.shape and out.dtype == dtype
        assert out.sharding.is_fully_replicated
        assert rel_err(out, want) < TOL[dtype]
    weave, baseline = (np.asarray(jnp.asarray(o, jnp.float32), np.float64) for o in outs[:2])
    assert rel_err(weave, baseline) < TOL[dtype]


def test_random_ragged_batch(cpu_mesh, rng):
    """A random ragged batch (seed printed), forced to split: weave == baseline == reference."""
    tp = int(rng.choice([2, 4, 8]))
    lengths = tuple(int(n) for n in rng.integers(1, 12, size=int(rng.integers(1, 5))))
    if sum(lengths) < 2:
        lengths = (*lengths, 3)
    print("tp", tp, "lengths", lengths)
    config, mesh = get_config("tiny"), cpu_mesh(tp)
    batch = plan_batch(lengths, tp=tp, split=True)
    dec = build(config, mesh, jnp.float32, rng)
    hidden = jnp.asarray(rng.standard_normal((batch.num_tokens, config.hidden_size)), jnp.float32)
    want = reference_decoder(logical_weights(dec), config, np.asarray(hidden, np.float64), lengths)
    for out in forward(dec, batch)(hidden):
        assert rel_err(out, want) < 1e-5


def test_split_cases_do_split():
    """The ragged cases above really exercise a split with a cut request."""
    assert plan_batch((5, 9, 3), tp=4, threshold=4).cut_request == 1
    assert plan_batch((3, 11, 7, 2), tp=8, threshold=8).cut_request is not None
    assert plan_batch((8, 8), tp=4, threshold=4).cut_request is None
    assert not plan_batch((7, 6), tp=4, threshold=1024).is_split
    big = plan_batch((100, 130, 70), tp=8, threshold=256)
    assert big.is_split and big.cut_request is not None


DEFAULT_THRESHOLD_LENGTHS = (1, 300, 517, 282)  # T = 1100 >= 1024, 1 token first


def test_default_threshold_split(cpu_mesh, rng):
    """The default threshold (1024), not a lowered one: a ragged batch of 1100 tokens splits
    at 640, inside request 2; weave == baseline == reference."""
    config, tp, lengths = get_config("tiny"), 4, DEFAULT_THRESHOLD_LENGTHS
    batch = plan_batch(lengths, tp=tp)
    assert batch.is_split and batch.num_tokens == 1100
    assert batch.cut_request == 2 and batch.half_lengths == (640, 460)
    assert not plan_batch((*lengths[:-1], lengths[-1] - 77), tp=tp).is_split  # T = 1023
    dec = build(config, cpu_mesh(tp), jnp.float32, rng)
    hidden = jnp.asarray(rng.standard_normal((batch.num_tokens, config.hidden_size)), jnp.float32)
    want = reference_decoder(logical_weights(dec), config, np.asarray(hidden, np.float64), lengths)
    weave, baseline = forward(dec, batch)(hidden)
    for out in (weave, baseline):
        assert out.shape == hidden.shape and out.sharding.is_fully_replicated
        assert rel_err(out, want) < 1e-5
    assert rel_err(weave, np.asarray(baseline, np.float64)) < 1e-5


def test_return_kv_and_nocomm(cpu_mesh, rng):
    config, tp, lengths = get_config("tiny"), 4, (5, 9, 3)
    mesh, batch = cpu_mesh(tp), plan_batch(lengths, tp=tp, threshold=4)
    dec = build(config, mesh, jnp.float32, rng)
    hidden = jnp.asarray(rng.standard_normal((batch.num_tokens, config.hidden_size)), jnp.float32)
    run = forward(dec, batch, (("weave", "xla"), ("baseline", "xla")), return_kv=True)
    (w_out, w_kv), (b_out, b_kv) = run(hidden)
    assert len(w_kv) == len(b_kv) == config.num_layers
    assert rel_err(w_out, np.asarray(b_out, np.float64)) < 1e-5
    shape = (batch.num_tokens, config.num_kv_heads, config.head_dim)
    for (wk, wv), (bk, bv) in zip(w_kv, b_kv, strict=True):
        assert wk.shape == wv.shape == bk.shape == shape
        for a, b in ((wk, bk), (wv, bv)):
            assert rel_err(a, np.asarray(b, np.float64)) < 1e-5
    # layer 0's keys: RoPE(input_norm(hidden) @ k_proj)
    w = logical_weights(dec)
    h = np.asarray(hidden, np.float64)
    x = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + config.rms_norm_eps)
    x = x * w["layers.0.input_layernorm"]
    inv = A.rope_inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    k0 = A.reference_rope((x @ w["layers.0.k_proj"]).reshape(shape), batch.positions(), inv)
    assert rel_err(w_kv[0][0], k0) < 1e-5
    # nocomm runs, has the right shape, and is NOT the model's output
    (nocomm,) = forward(dec, batch, (("nocomm", "auto"),))(hidden)
    assert nocomm.shape == hidden.shape
    assert rel_err(nocomm, np.asarray(b_out, np.float64)) > 1e-2


# Every configuration of the one layer loop (stack.run_stack): (schedule, comm, fake reducer).
# The fused kernel's two configurations run with pure-JAX stand-ins injected as reducers.
LOOP_CONFIGS = [
    ("baseline", "xla", None),
    ("weave", "xla", None),
    ("weave", "ffi", "overlap"),
    ("weave", "ffi-sync", "sync"),
    ("nocomm", "xla", None),
    ("weave", "local", None),
]
NOT_THE_MODEL = {"nocomm", "local"}


@pytest.mark.parametrize("tp", [1, 4])
def test_every_loop_configuration_against_reference(cpu_mesh, rng, tp):
    """Model-computing configurations match the float64 reference at TP 1 and 4; the comm-free
    ones (nocomm, weave-local) match it at TP 1 only (nothing to communicate) and differ at 4."""
    config, mesh = get_config("tiny"), cpu_mesh(tp)
    lengths = (5, 9, 3)
    batch = plan_batch(lengths, tp=tp, split=True)
    assert batch.cut_request is not None
    dec = build(config, mesh, jnp.float32, rng)
    hidden = jnp.asarray(rng.standard_normal((batch.num_tokens, config.hidden_size)), jnp.float32)
    want = reference_decoder(logical_weights(dec), config, np.asarray(hidden, np.float64), lengths)
    fake = FakeKernel()
    graphdef, state = nnx.split(dec)

    def run(state, hidden):
        model = nnx.merge(graphdef, state)
        return [
            model(hidden, batch, schedule=s, collective=c, reducer=getattr(fake, f) if f else None)
            for s, c, f in LOOP_CONFIGS
        ]

    outs = jax.jit(run)(state, hidden)
    fake.check_protocol()
    assert {op for op, _, _ in fake.log} == {"start", "done", "sync"}
    for (schedule, comm, _), out in zip(LOOP_CONFIGS, outs, strict=True):
        err = rel_err(out, want)
        if tp > 1 and {schedule, comm} & NOT_THE_MODEL:
            assert err > 1e-2, (schedule, comm, err)
        else:
            assert err < 1e-5, (schedule, comm, err)


def test_ffi_unavailable_on_cpu(cpu_mesh, rng):
    config, mesh = get_config("tiny", num_layers=1), cpu_mesh(2)
    dec = build(config, mesh, jnp.float32, rng)
    hidden = jnp.zeros((4, config.hidden_size), jnp.float32)
    with pytest.raises(RuntimeError, match="unavailable"):
        forward(dec, plan_batch((4,)), (("weave", "ffi"),))(hidden)


def test_bad_config_for_tp(cpu_mesh, rng):
    mesh = cpu_mesh(8)
    base = get_config("tiny", num_layers=1)
    with pytest.raises(ValueError, match="hidden_size"):
        WeaveDecoder(dataclasses.replace(base, hidden_size=36), mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_heads"):
        WeaveDecoder(
            dataclasses.replace(base, num_heads=12, num_kv_heads=4), mesh, rngs=nnx.Rngs(0)
        )
    # Fails on num_kv_heads alone: 16 heads divide by 8 (and everything divides by 4).
    kv4 = dataclasses.replace(base, num_heads=16, num_kv_heads=4)
    kv4.check_tensor_parallel(4)
    with pytest.raises(
        ValueError,
        match=r"^num_kv_heads=4 is not divisible by the "
        r"tensor-parallel degree 8; choose a TP degree",
    ):
        WeaveDecoder(kv4, mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="intermediate_size"):
        WeaveDecoder(dataclasses.replace(base, intermediate_size=100), mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="axis"):
        WeaveDecoder(base, mesh, axis_name="model", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_heads"):
        DecoderConfig(
            hidden_size=64,
            intermediate_size=64,
            num_layers=1,
            num_heads=6,
            num_kv_heads=4,
            head_dim=8,
        )


def test_bad_call_inputs(cpu_mesh, rng):
    config, mesh = get_config("tiny", num_layers=1), cpu_mesh(2)
    dec = build(config, mesh, jnp.float32, rng)
    h = config.hidden_size
    batch = plan_batch((3, 4))
    good = jnp.zeros((7, h), jnp.float32)
    cases = [
        (jnp.zeros((7, h + 2), jnp.float32), batch, {}, "hidden_size"),
        (jnp.zeros((8, h), jnp.float32), batch, {}, "sum to 7"),  # lengths don't sum to T
        (jnp.zeros((7, h), jnp.bfloat16), batch, {}, "dtype"),
        (jnp.zeros((7, h), jnp.int32), batch, {}, "floating"),
        (jnp.zeros((7 * h,), jnp.float32), batch, {}, "tokens, hidden_size"),
        (jnp.zeros((0, h), jnp.float32), batch, {}, "empty"),
        (good, (3, 4), {}, "BatchPlan"),
        (good, batch, {"schedule": "fast"}, "schedule"),
        (good, batch, {"collective": "nccl"}, "collective"),
    ]
    for hidden, plan, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            dec(hidden, plan, **kwargs)
    with pytest.raises(ValueError, match="empty"):
        plan_batch(())


def test_weights_sharded_as_documented(cpu_mesh, rng):
    config, mesh = get_config("tiny-qwen", num_layers=1), cpu_mesh(4)
    dec = build(config, mesh, jnp.bfloat16, rng)
    params = named_params(dec)
    d = config.head_dim
    expect = {
        "layers.0.qkv_proj": ((64, 32 * d), (64, 8 * d)),  # 16 q + 8 k + 8 v heads
        "layers.0.qkv_bias": ((32 * d,), (8 * d,)),
        "layers.0.o_proj": ((16 * d, 64), (4 * d, 64)),
        "layers.0.gate_up_proj": ((64, 256), (64, 64)),
        "layers.0.down_proj": ((128, 64), (32, 64)),
        "layers.0.input_layernorm": ((64,), (64,)),
        "final_norm": ((64,), (64,)),
    }
    assert not {"layers.0.q_proj", "layers.0.gate_proj"} & set(params)
    for name, (global_shape, shard_shape) in expect.items():
        value = params[name][...]
        assert value.shape == global_shape, name
        assert value.addressable_shards[0].data.shape == shard_shape, name
        assert value.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="unknown"):
        dec.load_weights({"layers.0.nope": np.zeros(3)}, strict=False)
    with pytest.raises(ValueError, match="shape"):
        dec.load_weights({"final_norm": np.zeros(3)}, strict=False)
    with pytest.raises(ValueError, match="missing"):
        dec.load_weights({"final_norm": np.zeros(64)})
    with pytest.raises(ValueError, match=r"layers\.0\.v_proj'\] missing"):
        dec.load_weights(
            {"layers.0.q_proj": np.zeros((64, 16 * d)), "layers.0.k_proj": np.zeros((64, 8 * d))},
            strict=False,
        )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_projections_are_rank_blocked(cpu_mesh, rng, tp):
    """Loading the logical q/k/v and gate/up weights fuses them so that each rank's shard of
    qkv_proj / qkv_bias / gate_up_proj is exactly [its q | its k | its v] (resp. [gate | up]),
    and logical_weights gives them back unchanged."""
    config, mesh = get_config("tiny-qwen", num_layers=1), cpu_mesh(tp)
    dec = build(config, mesh, jnp.float32, rng)
    logical = {
        n: rng.standard_normal(v.shape).astype(np.float32) for n, v in logical_weights(dec).items()
    }
    dec.load_weights(logical)
    back = logical_weights(dec)
    assert set(back) == set(logical)
    for name, value in logical.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    p = "layers.0."
    params = named_params(dec)
    for fused, parts in (
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("qkv_bias", ("q_bias", "k_bias", "v_bias")),
        ("gate_up_proj", ("gate_proj", "up_proj")),
    ):
        shards = params[p + fused][...].addressable_shards
        assert len(shards) == tp
        for r, shard in enumerate(sorted(shards, key=lambda s: s.index[-1].start or 0)):
            own = [np.split(logical[p + part], tp, axis=-1)[r] for part in parts]
            np.testing.assert_array_equal(np.asarray(shard.data), np.concatenate(own, -1))
