"""The KV cache on demand and the prefix cache through the engine, on a random tiny model:
preemption under a tiny pool gives the tokens of an unpreempted run (greedy and seeded, async
scheduling on and off, streams without a repeated token), prefix hits across requests and across
``generate`` calls give the uncached outputs, the weave split cutting a request whose prefix is
cached matches the float64 reference, and no block stays held after any way out of a call."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from testutil import SMALL_ENGINE

from jax_tokenweave.models.configs import get_config
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.nn.params import logical_weights
from jax_tokenweave.reference.model import reference_logits
from jax_tokenweave.serving import LLM, LLMEngine, RequestFailed, SamplingParams

CFG = SMALL_ENGINE  # the engine sizes these files share (testutil)
UNCACHED = dataclasses.replace(CFG, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def model():
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    return LlamaModel(get_config("tiny"), mesh, dtype=jnp.float32, rngs=nnx.Rngs(5))


def prompts(rng, lengths):
    return [rng.integers(0, 256, int(n)).tolist() for n in lengths]


def nothing_held(engine):
    """No request, no block in use; every cached block's hash points back at it."""
    a = engine.scheduler.allocator
    assert not engine.has_unfinished() and engine.num_blocks_in_use == 0
    assert a.num_free == a.num_blocks and not any(a._refs)
    assert all(a._hash[b] == h for h, b in a._cached.items())
    assert sum(h is not None for h in a._hash) == a.num_cached == engine.num_blocks_cached


def streamed(engine, ps, params):
    """Serve ``ps`` by ``step()``; per request the tokens its deltas carried and its output."""
    ids = [engine.add_request(p, sp) for p, sp in zip(ps, params, strict=True)]
    seen: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            seen.setdefault((d.request_id, d.index), []).extend(d.token_ids)
    outs = [engine.release(i) for i in ids]
    for i, out in zip(ids, outs, strict=True):
        for o in out.outputs:
            assert seen[(i, o.index)] == o.token_ids  # no token streamed twice
    return [[o.token_ids for o in out.outputs] for out in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_gives_the_tokens_of_an_unpreempted_run(model, rng, async_scheduling):
    ps = prompts(rng, (20, 13, 25, 9, 17, 30))
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=18, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, n=2, seed=9, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True),  # the engine's seed
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    big = LLMEngine(model, dataclasses.replace(UNCACHED, async_scheduling=async_scheduling))
    want = streamed(big, ps, params)
    assert big.kv_stats.preemptions == 0
    for caching in (False, True):
        small = LLMEngine(
            model,
            dataclasses.replace(
                CFG,
                num_blocks=14,
                async_scheduling=async_scheduling,
                enable_prefix_caching=caching,
            ),
        )
        assert streamed(small, ps, params) == want
        assert small.kv_stats.preemptions >= 3
        nothing_held(small)


def test_prefix_hits_across_requests_give_the_uncached_outputs(model, rng):
    system = rng.integers(0, 256, 22).tolist()
    ps = [system + q for q in prompts(rng, (5, 9, 3, 14))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in LLMEngine(model, UNCACHED).run_to_completion(ps, params)]
    engine = LLMEngine(model, CFG)
    ids, step = [], 0
    while len(ids) < len(ps) or engine.has_unfinished():  # one arrival a step
        if len(ids) < len(ps):
            ids.append(engine.add_request(ps[len(ids)], params))
        engine.step()
        step += 1
    assert [engine.release(i).token_ids for i in ids] == want
    stats = engine.kv_stats
    assert stats.prefix_cache_queries == sum(map(len, ps))
    assert stats.prefix_cache_hits >= 2 * 20  # the later ones found system's 5 full blocks
    assert stats.prefix_cache_hits % CFG.block_size == 0
    nothing_held(engine)


def test_prefix_hits_across_generate_calls(model, rng):
    llm = LLM(model, tokenizer=False, use_tqdm=False, config=CFG, num_gpu_blocks_override=40)
    assert llm.engine.config.num_blocks == 40 and llm.engine.config.enable_prefix_caching
    ps = prompts(rng, (17, 30))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(ps, params)]
    stats = llm.engine.kv_stats
    assert stats.prefix_cache_hits == 0 and llm.engine.num_blocks_cached > 0
    again = [o.token_ids for o in llm.generate(ps, params)]
    assert again == first and stats.prefix_cache_hits == 16 + 28  # (len - 1) // 4 blocks
    assert llm.reset_prefix_cache() and llm.engine.num_blocks_cached == 0
    assert [o.token_ids for o in llm.generate(ps, params)] == first
    assert stats.prefix_cache_hits == 16 + 28
    off = LLM(model, tokenizer=False, use_tqdm=False, config=CFG, enable_prefix_caching=False)
    assert [o.token_ids for o in off.generate(ps, params)] == first
    assert [o.token_ids for o in off.generate(ps, params)] == first
    assert off.engine.kv_stats.prefix_cache_hits == 0 and off.engine.num_blocks_cached == 0
    with pytest.raises(ValueError, match="num_gpu_blocks_override=8 and num_blocks=9 disagree"):
        LLM(model, tokenizer=False, num_gpu_blocks_override=8, num_blocks=9)


def reference_greedy(weights, config, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        logits = reference_logits(weights, config, np.asarray(tokens), [len(tokens)])[-1]
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_weave_split_cuts_a_request_whose_prefix_is_cached(rng, cpu_mesh, tp):
    """A 36-token cached prefix, 20 new tokens: the 24-row chunk of a 32-row woven step is cut
    by the split; its second half attends to the cached blocks as to the first half's."""
    config = get_config("tiny")
    model = LlamaModel(
        config, cpu_mesh(tp), dtype=jnp.float32, rngs=nnx.Rngs(int(rng.integers(1 << 30)))
    )
    engine = LLMEngine(model, CFG)
    first = rng.integers(0, 256, 40).tolist()
    second = first[:36] + rng.integers(0, 256, 20).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.run_to_completion([first], params)
    cut = engine.stats.cut_steps
    (out,) = engine.run_to_completion([second], params)
    assert engine.kv_stats.prefix_cache_hits == 36
    assert engine.stats.cut_steps == cut + 1
    assert out.token_ids == reference_greedy(logical_weights(model), config, second, 6)


class Interrupt:
    """Wraps ``runner.fetch``: raises ``KeyboardInterrupt`` on its ``at``-th call."""

    def __init__(self, fetch, at):
        self.fetch, self.at, self.calls = fetch, at, 0

    def __call__(self, step):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.fetch(step)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_block_is_held_after_any_way_out_of_a_call(model, rng, async_scheduling):
    cfg = dataclasses.replace(CFG, num_blocks=14, async_scheduling=async_scheduling)
    llm = LLM(model, tokenizer=False, use_tqdm=False, config=cfg)
    engine = llm.engine
    ps = prompts(rng, (20, 13, 25, 9))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(ps, params)]
    assert engine.kv_stats.preemptions > 0  # the pool is too small for all four at once
    nothing_held(engine)
    fetch = engine.runner.fetch
    for at in (2, 5, 9):  # an interrupted generate
        engine.runner.fetch = Interrupt(fetch, at)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(ps, params)
        engine.runner.fetch = fetch
        nothing_held(engine)
    for k in (1, 4, 11):  # a stream closed early
        stream = llm.stream(ps[k % 4], params)
        for _ in range(k):
            next(stream)
        stream.close()
        nothing_held(engine)
    pack = engine.runner.pack
    calls = {"n": 0}

    def failing_pack(scheduled):
        calls["n"] += 1
        if calls["n"] == 4:
            raise OverflowError("bad pack")
        return pack(scheduled)

    engine.runner.pack = failing_pack  # a step that fails: its requests fail
    with pytest.raises(RequestFailed, match="bad pack"):
        llm.generate(ps, params)
    engine.runner.pack = pack
    nothing_held(engine)
    ids = [engine.add_request(p, params) for p in ps]  # aborts mid-run
    for _ in range(6):
        engine.step()
    engine.abort_all(ids)
    while engine.has_unfinished():
        engine.step()
    nothing_held(engine)
    assert [o.token_ids for o in llm.generate(ps, params)] == want
    nothing_held(engine)
