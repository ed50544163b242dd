"""vLLM's penalties, ``logit_bias`` and ``min_tokens`` applied on the device
(``serving.sampling.processors``): the processed logits against a NumPy reference of vLLM's
formulas, greedy decoding with them against ``transformers``' logits processed by that reference,
the same tokens with async scheduling on and off and whatever a request is batched with (a slot
reused after a biased request carries nothing over), and no compilation after warm-up when
their values change."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hf_testutil import (
    TINY_ENGINE,
    import_or_skip,
    make_hf_model,
    save_char_tokenizer,
    save_checkpoint,
)
from vllm_reference import reference_greedy, vllm_processed

from jax_tokenweave.serving import LLM, SamplingParams, count_compilations
from jax_tokenweave.serving.sampling import processors

torch = import_or_skip("torch")
import_or_skip("transformers")

SIZES = dict(
    TINY_ENGINE,
    max_model_len=64,
    num_blocks=96,
    max_biased_tokens=8,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_apply_matches_vllm_formulas(rng):
    vocab, slots, k = 50, 3, 4
    state = processors.ProcessorState(
        jnp.zeros((slots + 1, vocab), jnp.int32),
        jnp.zeros((slots + 1, k), jnp.int32),
        jnp.zeros((slots + 1, k), jnp.float32),
        jnp.zeros((slots + 1, k), jnp.int32),
    )
    rows = []
    for slot in range(slots):
        prompt = rng.integers(0, vocab, int(rng.integers(1, 20)))
        output = rng.integers(0, vocab, int(rng.integers(0, 30)))
        entries = [
            (int(t), float(rng.normal(0, 3)), int(rng.integers(0, 40)))
            for t in rng.choice(vocab, 3, replace=False)
        ]
        entries.append((int(rng.integers(vocab)), -np.inf, 5))  # min_tokens' mask
        # the first tokens counted when the slot is written (a preempted request's, made
        # before it was recomputed), the others recorded as steps sample them
        before, after = output[: len(output) // 2], output[len(output) // 2 :]
        start = processors.slot_start(slot, prompt, before, entries, vocab, k)
        state = processors.start_slot(
            state,
            slot,
            start.ids,
            start.history,
            start.bias_ids,
            start.bias_values,
            start.bias_until,
        )
        for token in after:
            state.history = processors.record(
                state.history, jnp.asarray([slot]), jnp.asarray([token])
            )
        rows.append((slot, prompt, output, entries))
    logits = rng.normal(0, 3, (slots, vocab)).astype(np.float32)
    penalties = np.stack(
        [rng.uniform(-2, 2, slots), rng.uniform(-2, 2, slots), rng.uniform(0.5, 2.0, slots)], 1
    ).astype(np.float32)
    made = np.asarray([len(r[2]) for r in rows], np.int32) % 8
    got = processors.apply(
        jnp.asarray(logits), state, jnp.arange(slots), jnp.asarray(made), jnp.asarray(penalties)
    )
    for i, (_, prompt, output, entries) in enumerate(rows):
        ids, values, until = zip(*entries, strict=True)
        want = vllm_processed(
            logits[i], prompt, output, *penalties[i], (ids, values), until, made[i]
        )
        np.testing.assert_allclose(np.asarray(got[i]), want, rtol=1e-5, atol=1e-5)
    # defaults (0, 0, 1) and no bias: the logits as they were
    same = processors.apply(
        jnp.asarray(logits),
        state,
        jnp.full(slots, slots),  # the padding row
        jnp.zeros(slots, jnp.int32),
        jnp.tile(jnp.asarray([0.0, 0.0, 1.0]), (slots, 1)),
    )
    np.testing.assert_array_equal(np.asarray(same), logits)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_model("llama", seed=13)
    path = save_checkpoint(hf, str(tmp_path_factory.mktemp("penalties") / "tiny"))
    save_char_tokenizer(path)
    return path, hf


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, checkpoint):
    return LLM(
        checkpoint[0],
        use_tqdm=False,
        async_scheduling=request.param,
        compilation_cache_dir=None,
        **SIZES,
    )


CASES = [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0, frequency_penalty=-0.5),
    dict(presence_penalty=-1.0, repetition_penalty=1.3, frequency_penalty=0.7),
    dict(logit_bias={40: 3.0, 41: -2.5}, repetition_penalty=1.2),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_greedy_with_penalties_matches_the_reference(llm, checkpoint, case):
    params = dataclasses.replace(GREEDY, **case)
    (out,) = llm.generate("penalties here", params)
    want = reference_greedy(checkpoint[1], out.prompt_token_ids, params)
    assert out.token_ids == want
    (plain,) = llm.generate("penalties here", GREEDY)
    assert plain.token_ids != want  # the penalty changed something


def test_batched_and_alone_agree(llm, checkpoint):
    prompts = ["one two", "three", "four five six", "seven", "eight nine"]
    params = [
        dataclasses.replace(GREEDY, repetition_penalty=1.6, frequency_penalty=0.4),
        GREEDY,
        dataclasses.replace(GREEDY, logit_bias={60: 2.0}, presence_penalty=1.0),
        dataclasses.replace(GREEDY, min_tokens=4, stop_token_ids=(70,)),
        GREEDY,
    ]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == alone
    # a slot that held a biased request, then a plain one: nothing carried over
    strong = dataclasses.replace(GREEDY, logit_bias={60: 50.0})
    assert set(llm.generate("x", strong)[0].token_ids) == {60}
    assert llm.generate(prompts[1], GREEDY)[0].token_ids == alone[1]
    hf = checkpoint[1]
    out = llm.generate(prompts[0], params[0])[0]
    assert out.token_ids == reference_greedy(hf, out.prompt_token_ids, params[0])


@pytest.mark.slow
def test_new_values_compile_nothing(checkpoint):
    llm = LLM(checkpoint[0], use_tqdm=False, warmup=True, compilation_cache_dir=None, **SIZES)
    llm.generate(["warm", "up"], [GREEDY, dataclasses.replace(GREEDY, repetition_penalty=1.1)])
    with count_compilations() as compiles:
        for i, value in enumerate((0.3, 1.7, -1.2, 0.9)):
            params = SamplingParams(
                temperature=0.0 if i % 2 else 0.8,
                max_tokens=6,
                ignore_eos=True,
                presence_penalty=value,
                frequency_penalty=-value,
                repetition_penalty=1.0 + abs(value),
                logit_bias={i: value, 100 + i: -value},
                min_tokens=i,
                seed=i,
                logprobs=i % 2,
            )
            llm.generate(["prompt " * (i + 1), "x"], [params, GREEDY])
    assert compiles.count == 0
    llm.close()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_requests_keep_their_penalties_and_prompt_logprobs(rng, async_scheduling):
    """A request preempted (its blocks taken back, recomputed later) gets its slot written
    again with the tokens it had made: the tokens are those of an unpreempted run; prompt
    log-probabilities are scored once each (and computed, not taken from the prefix cache)."""
    import jax
    from flax import nnx
    from jax.sharding import Mesh

    from jax_tokenweave.models.configs import get_config
    from jax_tokenweave.models.llama import LlamaModel
    from jax_tokenweave.serving import EngineConfig, LLMEngine

    model = LlamaModel(
        get_config("tiny"),
        Mesh(np.array(jax.devices("cpu")[:1]), ("tp",)),
        dtype=jnp.float32,
        rngs=nnx.Rngs(7),
    )
    cfg = EngineConfig(
        **{**SIZES, "num_blocks": 64, "key_chunk": 8},
        async_scheduling=async_scheduling,
        compilation_cache_dir=None,
    )
    system = rng.integers(0, 256, 12).tolist()
    ps = [system + rng.integers(0, 256, int(n)).tolist() for n in (9, 14, 5, 11, 8)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(
            temperature=0.8, seed=3, max_tokens=18, ignore_eos=True, frequency_penalty=1.0
        ),
        SamplingParams(
            temperature=0.0,
            max_tokens=16,
            min_tokens=10,
            stop_token_ids=(5, 6),
            logit_bias={5: 3.0},
        ),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, presence_penalty=-1.5),
    ]
    big = LLMEngine(model, cfg)
    want = big.run_to_completion(ps, params)
    assert big.kv_stats.preemptions == 0
    small = LLMEngine(model, dataclasses.replace(cfg, num_blocks=16))
    got = small.run_to_completion(ps, params)
    assert small.kv_stats.preemptions >= 2
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    scored = got[3].prompt_logprobs
    assert len(scored) == len(ps[3]) and scored[0] is None
    for a, b in zip(scored[1:], want[3].prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5)
