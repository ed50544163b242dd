"""Serving loop: sampling, EOS / max-token stops, weave prefill of a cut request, static shapes
(no recompilation over a stream of requests), decode schedules and input errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from jax_tokenweave.models.configs import get_config
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.serving import Engine, ServingConfig, count_compilations, generate, sample
from jax_tokenweave.serving.buckets import batch_bucket, length_bucket, next_pow2
from jax_tokenweave.split import plan_batch


@pytest.fixture(scope="module")
def model():
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    return LlamaModel(get_config("tiny"), mesh, dtype=jnp.float32, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, ServingConfig(max_batch=4, max_seq_len=64))


def _prompts(rng: np.random.Generator, lengths) -> list[list[int]]:
    return [rng.integers(0, 256, int(n)).tolist() for n in lengths]


# ---- pieces --------------------------------------------------------------------------------

def test_buckets():
    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 17)] == [1, 1, 2, 4, 4, 8, 32]
    assert length_bucket(3) == 16 and length_bucket(17) == 32 and length_bucket(3, 4) == 4
    assert batch_bucket(3, 8) == 4 and batch_bucket(5, 6) == 6
    with pytest.raises(ValueError):
        length_bucket(0)


def test_sample_greedy_and_top_p(rng):
    logits = jnp.asarray(rng.normal(size=(6, 50)), jnp.float32)
    key = jax.random.key(0)
    greedy = np.argmax(np.asarray(logits), axis=-1)
    np.testing.assert_array_equal(sample(logits, key, 0.0, 1.0), greedy)
    # top_p tiny keeps only the most likely token, whatever the temperature.
    np.testing.assert_array_equal(sample(logits, key, 2.0, 1e-6), greedy)


def test_sample_distribution():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.log(np.tile(probs, (4000, 1))), jnp.float32)
    draws = np.asarray(sample(logits, jax.random.key(1), 1.0, 1.0))
    freq = np.bincount(draws, minlength=4) / draws.size
    np.testing.assert_allclose(freq, probs, atol=0.03)
    # top_p = 0.7: the nucleus is {0, 1} (0.5 + 0.3 >= 0.7), renormalised to 5/8, 3/8.
    draws = np.asarray(sample(logits, jax.random.key(2), 1.0, 0.7))
    freq = np.bincount(draws, minlength=4) / draws.size
    np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=0.03)


# ---- generate ------------------------------------------------------------------------------

def test_prefill_logits_match_model(model, engine, rng):
    prompts = _prompts(rng, (3, 9, 14))
    _, logits = engine.prefill(prompts, [0, 1, 2], jax.random.key(0))
    graphdef, state = nnx.split(model)
    plan = plan_batch([len(p) for p in prompts])
    forward = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, plan, schedule="baseline",
                                                             comm="xla"))
    want = np.asarray(forward(state, jnp.asarray(np.concatenate(prompts), jnp.int32)))
    last = np.cumsum([len(p) for p in prompts]) - 1
    np.testing.assert_allclose(logits, want[last], rtol=1e-5, atol=1e-5)


def test_eos_and_max_tokens(engine, rng):
    prompts = _prompts(rng, (4, 7))
    full = engine.generate(prompts, 12, eos_token_ids=())
    assert [len(o) for o in full] == [12, 12]
    eos = full[0][5]
    cut = engine.generate(prompts, 12, eos_token_ids=[eos])
    for f, c in zip(full, cut, strict=True):
        stop = f.index(eos) + 1 if eos in f else len(f)
        assert c == f[:stop]
    assert engine.generate(prompts, 1, eos_token_ids=()) == [f[:1] for f in full]
    # one id, as Hugging Face's eos_token_id may be, means the same as a list of it
    assert engine.generate(prompts, 12, eos_token_ids=eos) == cut
    assert engine.generate(prompts, 12, eos_token_ids=np.int64(eos)) == cut


def test_sampling_seeded(engine, rng):
    prompts = _prompts(rng, (5, 6))
    a = engine.generate(prompts, 10, temperature=1.0, top_p=0.9, seed=7, eos_token_ids=())
    b = engine.generate(prompts, 10, temperature=1.0, top_p=0.9, seed=7, eos_token_ids=())
    c = engine.generate(prompts, 10, temperature=1.0, top_p=0.9, seed=8, eos_token_ids=())
    assert a == b and a != c


def test_weave_split_cutting_a_prompt(model, engine, rng):
    """One prompt in a forced-split prefill: the split cuts it; greedy output is unchanged."""
    prompts = _prompts(rng, (21,))
    weave = Engine(model, ServingConfig(max_batch=4, max_seq_len=64, force_split=True))
    assert weave.plan(1, 32).cut_request == 0
    assert weave.generate(prompts, 16, eos_token_ids=()) == \
        engine.generate(prompts, 16, eos_token_ids=())


def test_more_prompts_than_cache_rows(engine, rng):
    prompts = _prompts(rng, (3, 5, 8, 2, 6, 9))
    together = engine.generate(prompts, 6, eos_token_ids=())
    alone = [engine.generate([p], 6, eos_token_ids=())[0] for p in prompts]
    assert together == alone


def test_no_recompilation_after_warmup(engine, rng):
    # Warm up every (prompts per group, length bucket) pair the stream below can hit.
    for lengths in ((3,), (3, 9), (3, 5, 9, 14), (20,), (17, 30), (17, 20, 25, 30)):
        engine.generate(_prompts(rng, lengths), 4, eos_token_ids=())
    with count_compilations() as counter:
        for _ in range(6):
            n = int(rng.integers(1, 5))
            lengths = rng.integers(1, 33, n)
            engine.generate(_prompts(rng, lengths), int(rng.integers(1, 20)),
                            temperature=float(rng.choice([0.0, 0.8])), top_p=0.9,
                            seed=int(rng.integers(100)), eos_token_ids=[int(rng.integers(256))])
    assert counter.count == 0


def test_no_recompilation_with_weave_split_prefill(rng):
    """TP 4, weave threshold 32 (padded prefill tokens), 2 cache rows: the counted stream mixes
    prefills that split cutting a prompt (1 x 32), split at a prompt boundary (2 x 16, 2 x 32)
    and do not split (1 x 16), within one ``generate`` call too; nothing compiles after the
    warm-up."""
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("tp",))
    model = LlamaModel(get_config("tiny", num_layers=1), mesh, dtype=jnp.float32,
                       rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    engine = Engine(model, ServingConfig(max_batch=2, max_seq_len=64, weave_threshold=32))
    assert not engine.plan(1, 16).split
    assert engine.plan(1, 32).cut_request == 0
    assert engine.plan(2, 16).split and engine.plan(2, 32).split
    # Warm up every (prompts per group, length bucket) pair the stream below can hit.
    for lengths in ((3,), (3, 9), (20,), (17, 30)):
        engine.generate(_prompts(rng, lengths), 4, eos_token_ids=())
    short, long = int(rng.integers(1, 17)), int(rng.integers(17, 33))
    stream = [(long,), (short, long)] + [rng.integers(1, 33, int(rng.integers(1, 5)))
                                         for _ in range(4)]
    with count_compilations() as counter:
        for lengths in stream:
            engine.generate(_prompts(rng, lengths), int(rng.integers(1, 20)),
                            temperature=float(rng.choice([0.0, 0.8])), top_p=0.9,
                            seed=int(rng.integers(100)), eos_token_ids=[int(rng.integers(256))])
    assert counter.count == 0


def test_compile_counter_counts():
    f = jax.jit(lambda x: x * 3 + 1)
    x4, x5 = np.ones(4, np.float32), np.ones(5, np.float32)
    with count_compilations() as counter:
        f(x4)
        f(x4)
        f(x5)
    assert counter.count == 2


def test_decode_schedules_agree(model, engine, rng):
    """Decode with the weave schedule (token-sharded residual, comm xla) and with baseline
    (psum, replicated residual) give the same greedy tokens."""
    prompts = _prompts(rng, (5, 11))
    baseline = Engine(model, ServingConfig(max_batch=4, max_seq_len=64, comm="xla",
                                           decode_schedule="baseline"))
    assert baseline.decode_schedule == "baseline" and engine.decode_schedule == "weave"
    assert baseline.generate(prompts, 8, eos_token_ids=()) == \
        engine.generate(prompts, 8, eos_token_ids=())


@pytest.mark.parametrize(("call", "match"), [
    (lambda e, m: e.generate([], 4), "no prompts"),
    (lambda e, m: generate(m, [], 4), "no prompts"),
    (lambda e, m: e.generate([[1, 2], []], 4), "prompt 1 is empty"),
    (lambda e, m: e.generate([[1, 256]], 4), "outside"),
    (lambda e, m: e.generate([[1.7, 2.2]], 4), "prompt 0's token id must be an integer"),
    (lambda e, m: e.generate([[True, 2]], 4), "token id must be an integer"),
    (lambda e, m: e.generate([1, 2, 3], 4), "prompt 0 must be a sequence of token ids"),
    (lambda e, m: e.generate("hello", 4), "sequence of token-id sequences"),
    (lambda e, m: e.generate([[1] * 40], 30), "max_seq_len"),
    (lambda e, m: e.generate([[1]], 0), "max_new_tokens must be >= 1"),
    (lambda e, m: e.generate([[1]], 2.5), "max_new_tokens must be an integer"),
    (lambda e, m: e.generate([[1]], None), "max_new_tokens must be an integer"),
    (lambda e, m: generate(m, [[1]], 2.5), "max_new_tokens must be an integer"),
    (lambda e, m: e.generate([[1]], 4, temperature=float("nan")), "temperature"),
    (lambda e, m: e.generate([[1]], 4, temperature=float("inf")), "temperature"),
    (lambda e, m: e.generate([[1]], 4, temperature=-1.0), "temperature"),
    (lambda e, m: e.generate([[1]], 4, temperature="hot"), "temperature"),
    (lambda e, m: e.generate([[1]], 4, temperature=1.0, top_p=0.0), "top_p"),
    (lambda e, m: e.generate([[1]], 4, temperature=1.0, top_p=1.5), "top_p"),
    (lambda e, m: e.generate([[1]], 4, temperature=1.0, top_p=float("nan")), "top_p"),
    (lambda e, m: e.generate([[1]], 4, eos_token_ids="x"), "eos_token_ids"),
    (lambda e, m: e.generate([[1]], 4, eos_token_ids=[1.5]), "eos token id"),
    (lambda e, m: e.generate([[1]], 4, seed=0.5), "seed"),
    (lambda e, m: Engine(m, {"max_batch": 2}), "ServingConfig"),
])
def test_input_errors(model, engine, call, match):
    with pytest.raises(ValueError, match=match):
        call(engine, model)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_batch": 0}, "max_batch must be >= 1"),
    ({"max_batch": 2.5}, "max_batch must be an integer"),
    ({"max_seq_len": "64"}, "max_seq_len must be an integer"),
    ({"min_prompt_bucket": 0}, "min_prompt_bucket"),
    ({"min_prompt_bucket": 32, "max_seq_len": 16}, "no prompt would fit"),
    ({"weave_threshold": 0}, "weave_threshold"),
    ({"schedule": "nocomm"}, "schedule"),
    ({"decode_schedule": "nocomm"}, "decode_schedule"),
    ({"comm": "nccl"}, "comm"),
    ({"force_split": "yes"}, "force_split"),
])
def test_serving_config_checked_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServingConfig(**kwargs)
