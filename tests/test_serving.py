"""The serving engine on a random tiny model: greedy outputs vs a float64 reference for requests
arriving at different steps and chunked across steps (weave on and off, a chunk cut by the
split), log-probabilities, sampling, stops, no compilation after warm-up over a stream of
arrivals, admission under a full cache, input errors, and a failed request beside others."""

from __future__ import annotations

import dataclasses
import re

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
from jax_tokenweave.serving import (
    LLMEngine,
    SamplingParams,
    count_compilations,
    generate_ids,
)
from jax_tokenweave.serving.runner import batch as batch_lib
from jax_tokenweave.serving.runner.step import jitted_forward
from jax_tokenweave.serving.sampling.sampling import sample

# 32-row steps in tiles of 8 (buckets 8/16/32 rows, decode segments of 0/8 rows): few programs.
CFG = SMALL_ENGINE  # the engine sizes these files share (testutil)


@pytest.fixture(scope="module")
def model():
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    return LlamaModel(get_config("tiny"), mesh, dtype=jnp.float32, rngs=nnx.Rngs(3))


def reference_greedy(weights, config, prompt, n):
    """Greedy continuation by the float64 reference, and each step's log-softmax."""
    tokens, lps = list(prompt), []
    for _ in range(n):
        logits = reference_logits(weights, config, np.asarray(tokens), [len(tokens)])[-1]
        lps.append(logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max())
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt) :], lps


def prompts(rng, lengths):
    return [rng.integers(0, 256, n).tolist() for n in lengths]


def run_with_arrivals(engine, arrivals, params):
    """``arrivals``: ``{step index: [prompt, ...]}``; returns outputs in arrival order."""
    ids, step = [], 0
    while step <= max(arrivals) or engine.has_unfinished():
        ids += [engine.add_request(p, params) for p in arrivals.get(step, [])]
        engine.step()
        step += 1
    return [engine.release(i) for i in ids]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])  # baseline and TP 1: tests/test_hf_parity.py
def test_greedy_matches_reference_with_arrivals_and_chunks(rng, cpu_mesh, tp):
    config = get_config("tiny")
    model = LlamaModel(
        config, cpu_mesh(tp), dtype=jnp.float32, rngs=nnx.Rngs(int(rng.integers(1 << 30)))
    )
    engine = LLMEngine(model, CFG)  # weave
    # 45 tokens need two 32-row steps; 21 arrives while the first decodes; 3 comes late.
    arrivals = {0: prompts(rng, (45, 6)), 2: prompts(rng, (21,)), 5: prompts(rng, (3,))}
    outs = run_with_arrivals(
        engine, arrivals, SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    )
    weights = logical_weights(model)
    for out, prompt in zip(outs, [p for s in sorted(arrivals) for p in arrivals[s]], strict=True):
        want, lps = reference_greedy(weights, config, prompt, 8)
        assert out.token_ids == want and out.finish_reason == "length"
        for got, lp in zip(out.outputs[0].token_logprobs, lps, strict=True):
            top = np.argsort(-lp)[:3]
            assert [t for t, _ in got.top] == top.tolist()
            np.testing.assert_allclose([v for _, v in got.top], lp[top], atol=1e-4)
            assert got.logprob == pytest.approx(lp[got.token_id], abs=1e-4)
    assert engine.stats.split_steps > 0 and engine.stats.cut_steps > 0


@pytest.mark.parametrize("schedule", ["weave", "baseline"])
def test_step_updates_the_cache_in_place(model, schedule):
    """The compiled step writes the paged cache in place: no copy of a whole cache buffer,
    also where the split makes half B write the buffer half A's attention read."""
    engine = LLMEngine(model, dataclasses.replace(CFG, schedule=schedule))
    layout = batch_lib.make_layout(8, 32, engine.config, engine.model_config, engine.tp)
    assert layout.plan.is_split == (schedule == "weave")
    cfg = engine.config
    text = (
        jitted_forward.lower(*engine.runner.padding_args(layout), **engine.runner._static(layout))
        .compile()
        .as_text()
    )
    shape = f"f32[{cfg.num_blocks},{cfg.block_size},{engine.model_config.num_kv_heads // 2},"
    copies = [
        line
        for line in text.splitlines()
        if re.search(rf"= {re.escape(shape)}\d+\]\S* copy\(", line)
    ]
    assert text.count(shape) > 0 and copies == []


def test_stream_of_deltas_equals_final_output(model, rng):
    engine = LLMEngine(model, CFG)
    ids = [
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=6))
        for p in prompts(rng, (9, 30))
    ]
    seen: dict[str, list[int]] = {i: [] for i in ids}
    finished = {}
    while engine.has_unfinished():
        for delta in engine.step():
            seen[delta.request_id] += delta.token_ids
            if delta.finished:
                finished[delta.request_id] = delta.finish_reason
    for i in ids:
        out = engine.release(i)
        assert seen[i] == out.token_ids and finished[i] == out.finish_reason == "length"


def test_sampling_is_per_request_and_seeded(model, rng):
    engine = LLMEngine(model, CFG)
    ps = prompts(rng, (7, 12, 20))
    hot = SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=8)
    alone = engine.run_to_completion([ps[0]], hot)[0].token_ids
    mixed = engine.run_to_completion(
        ps,
        [
            hot,
            SamplingParams(temperature=0.0, max_tokens=8),
            SamplingParams(temperature=0.7, seed=3, max_tokens=8),
        ],
    )
    assert mixed[0].token_ids == alone  # batching does not matter
    other = engine.run_to_completion([ps[0]], dataclasses.replace(hot, seed=12))[0].token_ids
    assert other != alone
    greedy = engine.run_to_completion([ps[2]], SamplingParams(temperature=0.0, max_tokens=8))[
        0
    ].token_ids
    top1 = engine.run_to_completion(
        [ps[2]], SamplingParams(temperature=5.0, top_k=1, seed=1, max_tokens=8)
    )[0].token_ids
    assert top1 == greedy


def test_sample_distribution():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = jnp.asarray(np.log(np.tile(probs, (n, 1))), jnp.float32)
    seeds, counters = jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32)

    def freq(top_p, top_k):
        draws = np.asarray(
            sample(
                logits,
                seeds,
                counters,
                jnp.ones(n),
                jnp.full(n, top_p),
                jnp.full(n, top_k, jnp.int32),
            )
        )
        return np.bincount(draws, minlength=4) / n

    np.testing.assert_allclose(freq(1.0, 0), probs, atol=0.03)
    np.testing.assert_allclose(freq(0.7, 0), [0.625, 0.375, 0, 0], atol=0.03)  # nucleus {0, 1}
    np.testing.assert_allclose(freq(1.0, 3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=0.03)


def test_stop_tokens_and_ignore_eos(model, rng):
    ps = prompts(rng, (5, 8))
    full = LLMEngine(model, CFG).run_to_completion(
        ps, SamplingParams(temperature=0.0, max_tokens=10)
    )
    stop = full[0].token_ids[3]
    first = full[0].token_ids.index(stop)
    out = LLMEngine(model, CFG).run_to_completion(
        ps, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(stop,))
    )
    assert out[0].token_ids == full[0].token_ids[: first + 1]
    assert out[0].finish_reason == "stop"
    eos = LLMEngine(model, CFG, eos_token_ids=stop)
    assert (
        eos.run_to_completion([ps[0]], SamplingParams(temperature=0.0, max_tokens=10))[
            0
        ].finish_reason
        == "stop"
    )
    kept = eos.run_to_completion(
        [ps[0]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    )[0]
    assert kept.token_ids == full[0].token_ids and kept.finish_reason == "length"


@pytest.mark.slow
def test_no_compilation_after_warmup_over_a_stream_of_arrivals(model, rng):
    engine = LLMEngine(model, dataclasses.replace(CFG, schedule="weave"))
    assert engine.warmup().layouts == len(engine.layouts()) >= 6
    with count_compilations() as counter:
        pending = [(int(rng.integers(0, 12)), p) for p in prompts(rng, rng.integers(1, 40, 7))]
        step = 0
        while pending or engine.has_unfinished():
            for arrival, p in [x for x in pending if x[0] <= step]:
                engine.add_request(
                    p,
                    SamplingParams(
                        max_tokens=int(rng.integers(1, 12)),
                        temperature=float(rng.choice([0, 0.8])),
                        top_p=0.9,
                        top_k=int(rng.integers(0, 5)),
                        seed=int(rng.integers(100)),
                        logprobs=int(rng.integers(0, 4)),
                    ),
                )
                pending.remove((arrival, p))
            engine.step()
            step += 1
    assert counter.count == 0
    assert engine.stats.split_steps > 0


def test_reserved_cache_makes_requests_wait_not_fail(model, rng):
    """Reserved blocks: six requests of ~13 blocks each, a cache of 48 blocks: they queue
    (three run at a time) and all finish with the outputs they have alone (the second time
    from the prefix cache); the cache is free again at the end."""
    ps = prompts(rng, (40, 35, 44, 30, 38, 41))
    params = SamplingParams(temperature=0.0, max_tokens=12)
    engine = LLMEngine(model, dataclasses.replace(CFG, kv_allocation="reserve"))
    alone = [engine.run_to_completion([p], params)[0].token_ids for p in ps]
    ids = [engine.add_request(p, params) for p in ps]
    most, queued = 0, 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.scheduler.running))
        queued = max(queued, len(engine.scheduler.waiting) * (most == 3))
    assert most == 3 and queued > 0  # blocks, not max_num_seqs (4), kept them waiting
    assert [engine.release(i).token_ids for i in ids] == alone
    assert engine.scheduler.allocator.num_free == CFG.num_blocks


def test_failed_request_does_not_disturb_the_others(model, rng):
    ps = prompts(rng, (13, 6))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    want = [o.token_ids for o in LLMEngine(model, CFG).run_to_completion(ps, params)]
    engine = LLMEngine(model, CFG)
    ids = [engine.add_request(p, params) for p in ps]
    engine.step()
    for bad in ([], [1, 300], [1.5], "hello", [1] * 70):
        with pytest.raises(ValueError):
            engine.add_request(bad, params)
    doomed = engine.add_request(ps[0], params)
    engine.step()
    engine.abort(doomed)
    while engine.has_unfinished():
        engine.step()
    assert [engine.release(i).token_ids for i in ids] == want
    assert engine.release(doomed).finish_reason == "abort"
    assert engine.scheduler.allocator.num_free == CFG.num_blocks


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda e: e.run_to_completion([]), "no prompts"),
        (lambda e: e.run_to_completion([[1, 2], []]), "prompt 1 is empty"),
        (lambda e: e.run_to_completion([[1, 256]]), "outside"),
        (lambda e: e.run_to_completion([[1.7, 2.2]]), "prompt 0's token id must be an integer"),
        (lambda e: e.run_to_completion([[True, 2]]), "token id must be an integer"),
        (lambda e: e.run_to_completion([1, 2, 3]), "prompt 0 must be a sequence of token ids"),
        (
            lambda e: e.run_to_completion(
                [[1] * 60], SamplingParams(temperature=0.0, max_tokens=8)
            ),
            "max_model_len",
        ),
        (
            lambda e: e.run_to_completion([[1]], SamplingParams(temperature=0.0, stop=("x",))),
            "tokenizer",
        ),
        (
            lambda e: e.run_to_completion([[1]], SamplingParams(temperature=0.0, logprobs=5)),
            "max_logprobs",
        ),
        (lambda e: e.run_to_completion([[1]], {"max_tokens": 3}), "SamplingParams"),
        (lambda e: e.run_to_completion([[1], [2]], [SamplingParams(temperature=0.0)]), "2 prompts"),
        (lambda e: LLMEngine(e.model, {"max_num_seqs": 2}), "EngineConfig"),
    ],
)
def test_input_errors(model, call, match):
    engine = LLMEngine(model, CFG)
    engine.model = model
    with pytest.raises(ValueError, match=match):
        call(engine)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": 0.5}, "seed"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_tokens": 17}, r"min_tokens \(17\) must be <= max_tokens \(16\)"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias token id must be an integer"),
        ({"logit_bias": {3: float("inf")}}, r"logit_bias\[3\] must be finite"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_sampling_params_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalised():
    p = SamplingParams(temperature=1, stop="end", stop_token_ids=[np.int64(3)])
    assert p.temperature == 1.0 and p.stop == ("end",) and p.stop_token_ids == (3,)
    assert SamplingParams(temperature=0.0).greedy and not p.greedy
    assert SamplingParams().temperature == 1.0 and SamplingParams().n == 1  # vLLM's


def test_generate_one_call(model, rng):
    ps = prompts(rng, (4, 10))
    got = generate_ids(model, ps, 5)
    want = [
        o.token_ids
        for o in LLMEngine(model, CFG).run_to_completion(
            ps, SamplingParams(temperature=0.0, max_tokens=5)
        )
    ]
    assert got == want


def test_logprobs_only_where_asked(model, rng):
    """A step computes log-probabilities only where one of its requests asked (zeros else); a
    request's log-probabilities do not depend on whether its neighbours asked for them."""
    ps = prompts(rng, (9, 14))
    engine = LLMEngine(model, CFG)
    both = engine.run_to_completion(ps, SamplingParams(temperature=0.0, max_tokens=5, logprobs=2))
    mixed = engine.run_to_completion(
        ps,
        [
            SamplingParams(temperature=0.0, max_tokens=5, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=5),
        ],
    )
    assert mixed[1].outputs[0].logprobs is None and [o.token_ids for o in mixed] == [
        o.token_ids for o in both
    ]
    for got, want in zip(
        mixed[0].outputs[0].token_logprobs, both[0].outputs[0].token_logprobs, strict=True
    ):
        assert got.token_id == want.token_id and [t for t, _ in got.top] == [t for t, _ in want.top]
        np.testing.assert_allclose(
            [got.logprob, *(v for _, v in got.top)],
            [want.logprob, *(v for _, v in want.top)],
            atol=1e-5,
        )
    engine.add_request(ps[0], SamplingParams(temperature=0.0, max_tokens=2))
    layout, arrays = engine.runner.pack(engine.scheduler.schedule())
    assert not arrays.want_logprobs
    outputs = engine.runner.run(layout, arrays)
    assert not np.asarray(outputs.top_logprobs).any() and not np.asarray(outputs.logprob).any()
