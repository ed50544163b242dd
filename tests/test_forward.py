"""The model's one forward (``nn.forward.decoder_forward``): the bare stack, the model and the
serving step all run through it, and its options are checked where they are made."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_tokenweave.models.configs import get_config
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.nn import forward as forward_lib
from jax_tokenweave.nn.decoder import WeaveDecoder
from jax_tokenweave.nn.forward import ForwardOptions, forward_options
from jax_tokenweave.nn.prefill import PrefillAttention
from jax_tokenweave.serving import EngineConfig
from jax_tokenweave.serving.attention.paged_attention import PagedAttention
from jax_tokenweave.serving.runner import batch as batch_lib
from jax_tokenweave.serving.runner import step as step_lib
from jax_tokenweave.serving.runner.runner import ModelRunner
from jax_tokenweave.weave.plan import plan_batch
from jax_tokenweave.weave.tuning import TuneEntry

ENGINE = EngineConfig(
    max_num_batched_tokens=32,
    max_num_seqs=4,
    prefill_tile=16,
    block_size=4,
    num_blocks=16,
    max_model_len=32,
    key_chunk=8,
    collective="xla",
    compilation_cache_dir=None,
)


@pytest.fixture
def spy(monkeypatch):
    """Records each call of ``decoder_forward`` (its attention and options), then runs it."""
    calls: list[tuple[object, ForwardOptions]] = []
    real = forward_lib.decoder_forward

    def recording(decoder, hidden, batch, attention, options=None, **kw):
        options = options or ForwardOptions()
        calls.append((attention, options))
        return real(decoder, hidden, batch, attention, options, **kw)

    monkeypatch.setattr(forward_lib, "decoder_forward", recording)
    return calls


def test_the_bare_stack_the_model_and_the_serving_step_share_one_forward(cpu_mesh, spy):
    config, mesh = get_config("tiny", num_layers=2), cpu_mesh(2)
    model = LlamaModel(config, mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
    plan = plan_batch((5, 3), tp=2)
    hidden = jnp.zeros((plan.num_tokens, config.hidden_size), jnp.float32)

    jax.eval_shape(lambda h: model.decoder(h, plan, schedule="baseline"), hidden)
    jax.eval_shape(lambda t: model(t, plan, collective="xla"), jnp.zeros(8, jnp.int32))
    runner = ModelRunner(model, ENGINE)
    layout = batch_lib.make_layout(16, 32, ENGINE, config, 2)
    forward = functools.partial(step_lib.forward, **runner._static(layout))
    jax.eval_shape(forward, *runner.padding_args(layout))

    kinds = [type(attention) for attention, _ in spy]
    assert kinds == [PrefillAttention, PrefillAttention, PagedAttention]
    assert [options.schedule for _, options in spy] == ["baseline", "weave", "weave"]
    assert spy[1][1].collective == "xla"
    assert (
        spy[2][1]
        == runner.options
        == ForwardOptions(schedule="weave", collective="xla", attention="auto", key_chunk=8)
    )


def test_return_kv_is_the_prefill_attentions_results(cpu_mesh, rng):
    config, mesh = get_config("tiny", num_layers=2), cpu_mesh(2)
    dec = WeaveDecoder(config, mesh, dtype=jnp.float32, rngs=nnx.Rngs(1))
    plan = plan_batch((5, 9), tp=2, split=True)
    hidden = jnp.asarray(rng.standard_normal((plan.num_tokens, config.hidden_size)), jnp.float32)
    out, kv = dec(hidden, plan, schedule="baseline", return_kv=True)
    alone = dec(hidden, plan, schedule="baseline")
    np.testing.assert_allclose(np.asarray(out), np.asarray(alone), rtol=1e-6, atol=1e-6)
    assert len(kv) == config.num_layers
    shape = (plan.num_tokens, config.num_kv_heads, config.head_dim)
    assert all(k.shape == v.shape == shape for k, v in kv)


def test_forward_options_check_their_fields():
    assert ForwardOptions() == ForwardOptions(schedule="weave", collective="auto")
    hash(ForwardOptions(tuning=TuneEntry(None, 8)))  # a static jit argument
    for bad, match in [
        (dict(schedule="fast"), "schedule must be one of"),
        (dict(collective="nccl"), "collective must be one of"),
        (dict(tuning=16), "tuning must be a tuning.TuneEntry"),
        (dict(attention="flash"), "attention must be one of"),
        (dict(key_chunk=0), "key_chunk must be >= 1"),
        (dict(key_chunk=8.0), "key_chunk must be an int"),
    ]:
        with pytest.raises(ValueError, match=match):
            ForwardOptions(**bad)
    with pytest.raises(ValueError, match=r"unknown forward options \['colective'\]"):
        forward_options(None, {"colective": "xla"})
    base = ForwardOptions(schedule="baseline")
    assert forward_options(base, {"key_chunk": 16}) == ForwardOptions("baseline", key_chunk=16)
    not_options: Any = {"schedule": "baseline"}
    with pytest.raises(ValueError, match="options must be a ForwardOptions"):
        forward_options(not_options, {})


def test_the_attention_resolves_its_implementation(cpu_mesh):
    config, mesh = get_config("tiny", num_layers=1), cpu_mesh(2)
    dec = WeaveDecoder(config, mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
    plan = plan_batch((4,), tp=2)
    hidden = jnp.zeros((4, config.hidden_size), jnp.float32)
    with pytest.raises(ValueError, match="prefill's attention implementation must be one of"):
        dec(hidden, plan, attention="cuda")
    assert PrefillAttention().resolve("auto", "cpu", jnp.float32, config) == "xla"
    assert PrefillAttention().resolve("cudnn", "cpu", jnp.float32, config) == "cudnn"
