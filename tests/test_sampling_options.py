"""vLLM's sampling options through the offline API (``LLM``): ``min_tokens`` (stop tokens, EOS
and stop strings held back), ``logit_bias``, ``max_tokens=None`` (up to the model's length),
``prompt_logprobs`` (against ``transformers``, across chunked prefill, vLLM's layout), the
checks of each against the engine (vocabulary, capacity), and a vLLM script using penalties,
``max_tokens=None``, ``n``, ``logprobs`` and ``stop`` that runs with only its import changed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hf_testutil import (
    TINY_ENGINE,
    import_or_skip,
    make_hf_model,
    save_char_tokenizer,
    save_checkpoint,
)
from vllm_reference import reference_greedy

from jax_tokenweave.serving import LLM, SamplingParams

torch = import_or_skip("torch")
import_or_skip("transformers")

SIZES = dict(
    TINY_ENGINE,
    max_model_len=64,
    num_blocks=96,
    max_biased_tokens=6,
    max_logprobs=5,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
EOS = 2  # transformers' LlamaConfig default


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_model("llama", seed=29)
    path = save_checkpoint(hf, str(tmp_path_factory.mktemp("options") / "tiny"))
    save_char_tokenizer(path)
    return path, hf


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[0], use_tqdm=False, **SIZES)


def test_min_tokens_holds_eos_stop_tokens_and_stop_strings_back(llm, checkpoint):
    assert llm.engine.eos_token_ids == {EOS}
    forced = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0})
    (eos_at_once,) = llm.generate("min tokens", forced)
    assert eos_at_once.token_ids == [EOS] and eos_at_once.finish_reason == "stop"
    (held,) = llm.generate("min tokens", dataclasses.replace(forced, min_tokens=3))
    assert held.token_ids[3:] == [EOS] and EOS not in held.token_ids[:3]
    assert held.finish_reason == "stop"
    (full,) = llm.generate("min tokens", GREEDY)
    stop_token = full.token_ids[1]
    params = dataclasses.replace(GREEDY, stop_token_ids=(stop_token,), min_tokens=4)
    (out,) = llm.generate("min tokens", params)
    assert stop_token not in out.token_ids[:4]
    assert out.token_ids == reference_greedy(checkpoint[1], out.prompt_token_ids, params)
    # a stop string counts only once it ends past the first min_tokens tokens' text
    text, stop = full.text, full.text[0]
    (cut,) = llm.generate("min tokens", dataclasses.replace(GREEDY, stop=(stop,), min_tokens=3))
    later = text.find(stop, 3)
    if later >= 0:
        assert cut.text == text[:later] and cut.finish_reason == "stop"
    else:
        assert cut.text == text and cut.finish_reason == "length"
    (plain,) = llm.generate("min tokens", dataclasses.replace(GREEDY, stop=(stop,)))
    assert plain.text == "" and plain.finish_reason == "stop"


def test_logit_bias(llm, checkpoint):
    (full,) = llm.generate("bias", GREEDY)
    (forced,) = llm.generate("bias", dataclasses.replace(GREEDY, logit_bias={77: 100.0}))
    assert forced.token_ids == [77] * 10
    banned = dataclasses.replace(GREEDY, logit_bias={full.token_ids[0]: -100.0})
    (out,) = llm.generate("bias", banned)
    assert full.token_ids[0] not in out.token_ids
    assert out.token_ids == reference_greedy(checkpoint[1], out.prompt_token_ids, banned)
    drawn = SamplingParams(n=3, seed=5, max_tokens=6, ignore_eos=True, logit_bias={99: 100.0})
    (samples,) = llm.generate("bias", drawn)
    assert all(o.token_ids == [99] * 6 for o in samples.outputs)
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 256\)"):
        llm.generate("x", SamplingParams(logit_bias={256: 1.0}))
    with pytest.raises(ValueError, match="more than the engine's max_biased_tokens"):
        llm.generate("x", SamplingParams(logit_bias=dict.fromkeys(range(7), 1.0)))
    fits = SamplingParams(max_tokens=2, logit_bias=dict.fromkeys(range(5), 1.0), min_tokens=1)
    assert llm.generate("x", fits)[0].finished  # 5 + EOS: 6
    with pytest.raises(ValueError, match=r"bias 7 tokens.*max_biased_tokens \(6\)"):
        llm.generate("x", dataclasses.replace(fits, logit_bias=dict.fromkeys(range(6), 1.0)))
    assert not llm.engine.has_unfinished()


def test_max_tokens_none_runs_to_the_models_length(llm):
    (out,) = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(out.token_ids) == SIZES["max_model_len"] - len(out.prompt_token_ids)
    assert out.finish_reason == "length"
    with pytest.raises(ValueError, match="leave no room for a new one"):
        llm.generate([list(range(3, 67))], SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match=r"min_tokens \(70\) must be <= max_tokens"):
        llm.generate("abc", SamplingParams(max_tokens=None, min_tokens=70))


def test_prompt_logprobs_match_transformers(llm, checkpoint):
    prompt = "a prompt long enough to be prefilled in two chunks!"  # 53 tokens, chunks of 32
    params = SamplingParams(n=2, temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    (out,) = llm.generate(prompt, params)
    ids = out.prompt_token_ids
    assert len(ids) > SIZES["max_num_batched_tokens"]
    with torch.no_grad():
        logits = checkpoint[1](torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry, row = out.prompt_logprobs[i], lp[i - 1]
        token = ids[i]
        assert entry[token].logprob == pytest.approx(row[token], abs=1e-4)
        assert entry[token].rank == int(np.sum(row >= row[token] - 1e-9))
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
        top = sorted((e.rank, t) for t, e in entry.items() if e.rank is not None and e.rank <= 3)
        assert [r for r, _ in top] == [1, 2, 3]
        assert [t for _, t in top] == np.argsort(-row)[:3].tolist()
        for _, t in top:
            assert entry[t].logprob == pytest.approx(row[t], abs=1e-4)
    (again,) = llm.generate(prompt, dataclasses.replace(params, prompt_logprobs=None))
    assert again.prompt_logprobs is None
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    deltas = list(llm.stream(prompt, params))
    firsts = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(firsts) == 1 and firsts[0].index == 0
    assert [e.logprob for e in firsts[0].prompt_logprobs] == [
        out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))
    ]
    with pytest.raises(ValueError, match=r"prompt_logprobs=6 exceeds the engine's max_logprobs"):
        llm.generate(prompt, SamplingParams(prompt_logprobs=6))
    assert not llm.engine.has_unfinished() and llm.engine.num_blocks_in_use == 0


VLLM_SCRIPT = """
from vllm import LLM, SamplingParams

prompts = ["Hello, my name is", "The capital of France is"]
sampling_params = SamplingParams(
    n=2,
    temperature=0.8,
    top_p=0.95,
    seed=7,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    repetition_penalty=1.1,
    max_tokens=None,
    logprobs=2,
    stop=["\\n"],
)
llm = LLM(model=MODEL, **SIZES)
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    for sample in output.outputs:
        print(f"{output.prompt!r} -> {sample.text!r} ({sample.finish_reason}), "
              f"{len(sample.logprobs)} logprobs, cumulative {sample.cumulative_logprob:.3f}")
"""


@pytest.mark.slow
def test_a_vllm_script_with_penalties_runs_with_only_the_import_changed(checkpoint, capsys):
    code = VLLM_SCRIPT.replace("from vllm import", "from jax_tokenweave import")
    namespace = {"MODEL": checkpoint[0], "SIZES": dict(SIZES, use_tqdm=False)}
    exec(compile(code, "vllm_script.py", "exec"), namespace)
    outputs, llm = namespace["outputs"], namespace["llm"]
    assert capsys.readouterr().out.count(" -> ") == 4
    for out in outputs:
        assert len(out.outputs) == 2 and out.finished
        for sample in out.outputs:
            assert "\n" not in sample.text and sample.finish_reason in ("stop", "length")
            assert len(sample.logprobs) == len(sample.token_ids) >= 1
            if sample.finish_reason == "length":  # max_tokens=None: the model's length
                assert len(sample.token_ids) == SIZES["max_model_len"] - len(out.prompt_token_ids)
            for token, entry in zip(sample.token_ids, sample.logprobs, strict=True):
                assert token in entry and sum(e.rank is not None for e in entry.values()) == 2
    assert not llm.engine.has_unfinished() and llm.engine.num_blocks_in_use == 0


def test_logit_bias_is_checked_read_only_and_pickles():
    import pickle

    params = SamplingParams(logit_bias={3: 1.5, np.int64(4): -2})
    assert params.logit_bias == {3: 1.5, 4: -2.0}
    with pytest.raises(TypeError, match="read-only"):
        params.logit_bias[5] = 1.0
    with pytest.raises(TypeError, match="read-only"):
        params.logit_bias.update({5: 1.0})
    assert pickle.loads(pickle.dumps(params)) == params
    assert dataclasses.replace(params, max_tokens=3).logit_bias == params.logit_bias
    with pytest.raises(ValueError, match="logit_bias token id must be >= 0"):
        SamplingParams(logit_bias={-1: 1.0})
