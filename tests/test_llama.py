"""``LlamaModel`` logits vs a float64 reference; named configs; weight loading."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from testutil import rel_err

from jax_tokenweave.models.configs import CONFIGS, config_names, get_config
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.nn.params import logical_weights, named_params
from jax_tokenweave.reference.model import reference_logits
from jax_tokenweave.weave.plan import plan_batch

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def compiled(model, batch, schedules, tokens):
    graphdef, state = nnx.split(model)

    def run(state, tokens):
        m = nnx.merge(graphdef, state)
        return [m(tokens, batch, schedule=s, collective="xla") for s in schedules]

    fn = (
        jax.jit(run)
        .lower(state, tokens)
        .compile(compiler_options={"xla_backend_optimization_level": 0})
    )
    return fn(state, tokens)


@pytest.mark.parametrize(
    ("name", "tp", "lengths", "dtype"),
    [
        ("tiny", 4, (5, 9, 3), jnp.float32),  # split with a cut request
        ("tiny-qwen", 2, (6, 7), jnp.bfloat16),  # qkv bias, tied embeddings
    ],
)
def test_logits_match_reference(cpu_mesh, rng, name, tp, lengths, dtype):
    config, mesh = get_config(name), cpu_mesh(tp)
    model = LlamaModel(config, mesh, dtype=dtype, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    assert hasattr(model, "lm_head") != config.tie_word_embeddings
    batch = plan_batch(lengths, tp=tp, threshold=4)
    assert batch.is_split
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, batch.num_tokens), jnp.int32)
    want = reference_logits(logical_weights(model), config, np.asarray(tokens), lengths)
    weave, baseline = compiled(model, batch, ("weave", "baseline"), tokens)
    for logits in (weave, baseline):
        assert logits.shape == (batch.num_tokens, config.vocab_size)
        assert logits.dtype == jnp.float32
        assert rel_err(logits, want) < TOL[dtype]


def test_load_weights_places_shards(cpu_mesh, rng):
    config, mesh = get_config("tiny", num_layers=1), cpu_mesh(4)
    model = LlamaModel(config, mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
    params = named_params(model)
    assert {
        "embed",
        "lm_head",
        "decoder.final_norm",
        "decoder.layers.0.qkv_proj",
        "decoder.layers.0.gate_up_proj",
        "decoder.layers.0.down_proj",
    } <= set(params)
    new = {name: rng.standard_normal(p[...].shape).astype(np.float32) for name, p in params.items()}
    model.load_weights(new)
    got = model.numpy_weights()
    for name, value in new.items():
        np.testing.assert_array_equal(got[name], value)
    embed = named_params(model)["embed"][...]
    assert embed.addressable_shards[0].data.shape == (config.vocab_size // 4, config.hidden_size)
    head = named_params(model)["lm_head"][...]
    assert head.addressable_shards[0].data.shape == (config.hidden_size, config.vocab_size // 4)
    # the embedding lookup (vocab-sharded + psum) returns the right rows
    tokens = jnp.asarray([0, 63, 64, 255, 128], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(model.embed_tokens(tokens)), new["embed"][np.asarray(tokens)]
    )


def test_bad_tokens(cpu_mesh):
    config, mesh = get_config("tiny", num_layers=1), cpu_mesh(2)
    model = LlamaModel(config, mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
    batch = plan_batch((3, 2))
    with pytest.raises(ValueError, match="integers"):
        model(jnp.zeros(5, jnp.float32), batch)
    with pytest.raises(ValueError, match="sum to 5"):
        model(jnp.zeros(6, jnp.int32), batch)
    with pytest.raises(ValueError, match="1-D"):
        model(jnp.zeros((5, 1), jnp.int32), batch)
    with pytest.raises(ValueError, match="vocab_size"):
        LlamaModel(get_config("tiny", vocab_size=255), mesh, rngs=nnx.Rngs(0))


# ------------------------------------------------------------------------------- configs ----


def test_named_configs():
    assert set(config_names()) >= {
        "tiny",
        "tiny-moe",
        "tiny-qwen",
        "llama3-8b",
        "llama3-70b",
        "qwen2.5-72b",
        "mixtral-8x22b",
    }
    c = get_config("llama3-70b")
    assert (
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.num_layers,
        c.vocab_size,
        c.rope_theta,
    ) == (8192, 28672, 64, 8, 128, 80, 128256, 500000.0)
    assert c.rope_scaling is not None and c.rope_scaling.factor == 8.0
    q = get_config("qwen2.5-72b")
    assert q.qkv_bias and q.intermediate_size == 29568 and q.rms_norm_eps == 1e-6
    m = get_config("mixtral-8x22b")
    assert (m.num_experts, m.experts_per_token, m.hidden_size, m.num_layers) == (8, 2, 6144, 56)
    for name, config in CONFIGS.items():
        for tp in (1, 2, 4, 8):
            config.check_tensor_parallel(tp)
            assert config.vocab_size % tp == 0, name
    assert get_config("llama3-70b", num_layers=4).num_layers == 4


def test_unknown_config():
    with pytest.raises(ValueError, match="llama3-70b"):
        get_config("gpt5")
    with pytest.raises(ValueError, match="fields"):
        get_config("tiny", num_layer=3)
