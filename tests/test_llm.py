"""The user API on a tiny Hugging Face checkpoint with a tokenizer: text in and out, prompt forms,
stop strings, streaming (sync and async) equal to the blocking call, clear errors that leave the
other requests alone, and the ``python -m jax_tokenweave.generate`` CLI."""

from __future__ import annotations

import asyncio
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hf_testutil import import_or_skip, make_hf_model, save_char_tokenizer, save_checkpoint

from jax_tokenweave import LLM, SamplingParams, generate
from jax_tokenweave.serving import EngineConfig

torch = import_or_skip("torch")  # under CI (env CI set): fail, never skip
import_or_skip("transformers")

ENGINE = EngineConfig(
    max_num_batched_tokens=32,
    max_num_seqs=4,
    prefill_tile=8,
    block_size=4,
    num_blocks=64,
    max_model_len=64,
    key_chunk=16,
    split_threshold=16,
    collective="xla",
)
CLI_ENGINE = [
    "--max-num-batched-tokens",
    "32",
    "--max-num-seqs",
    "4",
    "--prefill-tile",
    "8",
    "--block-size",
    "4",
    "--num-blocks",
    "64",
    "--max-model-len",
    "64",
    "--key-chunk",
    "16",
    "--split-threshold",
    "16",
    "--collective",
    "xla",
    "--tp",
    "2",
    "--dtype",
    "float32",
    "--temperature",
    "0",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_model("llama", seed=5)
    path = save_checkpoint(hf, str(tmp_path_factory.mktemp("llm")))
    save_char_tokenizer(path)
    return path, hf


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[0], tp=2, dtype=jnp.float32, config=ENGINE)


def test_text_in_text_out_matches_transformers(llm, checkpoint):
    hf = checkpoint[1]
    (out,) = llm.generate("Hello, world", GREEDY)
    assert out.prompt == "Hello, world" and out.prompt_token_ids[0] == 1  # BOS added
    assert out.prompt_token_ids == llm.encode("Hello, world")
    with torch.no_grad():
        ids = hf.generate(
            torch.tensor(out.prompt_token_ids)[None],
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert out.token_ids == ids[0, len(out.prompt_token_ids) :].tolist()
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason == "length" and len(out.text) > 0


def test_prompt_forms(llm):
    text = llm.generate("abc", GREEDY)[0]
    ids = llm.encode("abc")
    for prompts in (["abc"], ids, [ids], np.asarray(ids).tolist(), ("abc", ids)):
        outs = llm.generate(prompts, GREEDY)
        assert all(o.token_ids == text.token_ids for o in outs)
    assert llm.generate([ids])[0].prompt is None


def test_stream_equals_generate(llm):
    params = dataclasses.replace(GREEDY, logprobs=2)
    (want,) = llm.generate("The cat", params)
    deltas = list(llm.stream("The cat", params))
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert "".join(d.text for d in deltas) == want.text
    assert [lp for d in deltas for lp in d.logprobs] == want.outputs[0].token_logprobs
    assert deltas[-1].finish_reason == "length" and not any(d.finished for d in deltas[:-1])


def test_stop_strings_cut_the_text(llm):
    (full,) = llm.generate("Stop here", GREEDY)
    stop = full.text[4:6]
    cut = full.text.index(stop)
    params = dataclasses.replace(GREEDY, stop=(stop,))
    (out,) = llm.generate("Stop here", params)
    assert out.text == full.text[:cut] and out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    streamed = list(llm.stream("Stop here", params))
    assert "".join(d.text for d in streamed) == out.text
    assert streamed[-1].finish_reason == "stop"


def test_a_stop_string_at_the_last_allowed_token_is_a_stop(llm):
    """vLLM's: the stop string found in the text of the ``max_tokens``-th token ends the
    request with ``"stop"`` (its text cut), not ``"length"``."""
    (full,) = llm.generate("Stop late", GREEDY)
    stop = full.text[-1]
    cut = full.text.index(stop)
    params = dataclasses.replace(GREEDY, max_tokens=len(full.text[: cut + 1]), stop=(stop,))
    (out,) = llm.generate("Stop late", params)
    assert (out.text, out.finish_reason) == (full.text[:cut], "stop")
    streamed = list(llm.stream("Stop late", params))
    assert "".join(d.text for d in streamed) == out.text
    assert streamed[-1].finish_reason == "stop"


@pytest.mark.slow
def test_async_streams_run_together_and_a_bad_one_fails_alone(llm):
    prompts = ["one", "two two", "three three three"]
    want = [o.token_ids for o in llm.generate(prompts, GREEDY)]

    async def consume(prompt):
        return [t async for d in llm.astream(prompt, GREEDY) for t in d.token_ids]

    async def main():
        return await asyncio.gather(
            *(consume(p) for p in prompts), consume(""), consume([1, 999]), return_exceptions=True
        )

    got = asyncio.run(main())
    assert got[:3] == want
    assert isinstance(got[3], ValueError) and "empty" in str(got[3])
    assert isinstance(got[4], ValueError) and "outside" in str(got[4])
    assert not llm.engine.has_unfinished()


def test_closing_a_stream_early_aborts_it(llm):
    stream = llm.stream("abandon", GREEDY)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.allocator.num_free == ENGINE.num_blocks


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ([], None, "no prompts"),
        ("", None, "prompt 0 is an empty string"),
        (["ok", ""], None, "prompt 1 is an empty string"),
        ([[1, 2], []], None, "prompt 1 is empty"),
        ([[1.5, 2]], None, "must be an integer"),
        ([[1, 2], ["a"]], None, "must be an integer"),
        (b"bytes", None, "must be a sequence of token ids"),
        (3, None, "prompts must be"),
        ("x" * 60, GREEDY, "cannot fit"),
        (["ok", "a\udc80b"], None, r"prompt 1 is not valid Unicode: a lone surrogate '\\udc80' at"),
        (["a", "b"], [GREEDY], "2 prompts"),
    ],
)
def test_bad_prompts(llm, prompts, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished()


def test_without_tokenizer(checkpoint, cpu_mesh):
    from jax_tokenweave import from_pretrained

    model = from_pretrained(checkpoint[0], cpu_mesh(2), jnp.float32)
    bare = LLM(model, config=ENGINE, tokenizer=False)
    assert bare.tokenizer is None
    with pytest.raises(ValueError, match="need a tokenizer"):
        bare.generate("text")
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        bare.generate([[1, 2]], SamplingParams(temperature=0.0, stop=("x",)))
    with pytest.raises(ValueError, match="tensor_parallel_size and mesh apply to a checkpoint"):
        LLM(model, tp=2)
    assert generate is not None


def test_cli(checkpoint, capsys):
    from jax_tokenweave.generate import build_parser, main

    assert main([checkpoint[0], "--prompt", "Hello, world", "--max-tokens", "12", *CLI_ENGINE]) == 0
    printed = capsys.readouterr().out
    llm = LLM(checkpoint[0], tp=2, dtype=jnp.float32, config=ENGINE)
    want = llm.generate("Hello, world", SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert f"Hello, world -> {want.text}  [{want.finish_reason}]" in printed
    assert (
        main([checkpoint[0], "--ids", "1,2,3", "--max-tokens", "3", "--stream", *CLI_ENGINE]) == 0
    )
    assert (
        capsys.readouterr().out
        == llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))[0].text + "\n"
    )
    text = build_parser().format_help()
    assert "python -m jax_tokenweave.generate" in text and "(default: 8192)" in text
    with pytest.raises(SystemExit):
        main([checkpoint[0], "--temperature", "nan", "--prompt", "x"])
    capsys.readouterr()
    assert main([checkpoint[0] + "-missing", "--prompt", "x"]) == 1  # one line, no trace
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checkpoint directory does not exist" in err
    assert "Traceback" not in err
