"""``LLM``'s arguments are checked where they enter, with errors naming them: prompt dicts of the
wrong shape (token ids given as text, text given as token ids, unknown keys), chat messages
without a ``role`` or ``content``, a ``model`` that is neither a path nor a model, a
``tokenizer`` directory that does not exist or holds no tokenizer; and ``use_tqdm`` given to
``LLM`` or to ``generate`` (vLLM's) decides the "Processed prompts" bar."""

from __future__ import annotations

import pytest
from hf_testutil import CHAT_TEMPLATE, TINY_ENGINE, import_or_skip, save_tiny_llama

from jax_tokenweave.serving import LLM, LLMEngine, SamplingParams

import_or_skip("torch")
import_or_skip("transformers")

SIZES = dict(
    TINY_ENGINE,
    max_model_len=64,
    num_blocks=64,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("args") / "tiny", 3, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, use_tqdm=False, **SIZES)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ({"prompt_token_ids": "hello"}, r"prompt 0's 'prompt_token_ids' must be a sequence"),
        ({"prompt_token_ids": b"hi"}, r"'prompt_token_ids' must be a sequence of token ids"),
        ({"prompt": [7, 8]}, r"prompt 0's 'prompt' must be a string \(token ids go in"),
        ({"prompt": None}, r"'prompt' must be a string, got None"),
        ({"prompt": "a", "multi_modal_data": {}}, r"keys this LLM does not take: \['multi_"),
        ({}, "without 'prompt' or 'prompt_token_ids'"),
        ({"prompt_token_ids": [7, 8], "prompt": 3}, "'prompt' must be a string"),
    ],
)
def test_prompt_dicts_are_checked(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, GREEDY)
    with pytest.raises(ValueError, match=match.replace("prompt 0", "prompt")):
        next(llm.stream(prompt, GREEDY))
    assert not llm.engine.has_unfinished()


def test_prompt_dict_forms_served(llm):
    ids = llm.encode("abc")
    want = llm.generate("abc", GREEDY)[0]
    both = llm.generate({"prompt_token_ids": ids, "prompt": "abc"}, GREEDY)[0]
    assert both.token_ids == want.token_ids and both.prompt == "abc"
    assert llm.generate({"prompt_token_ids": ids}, GREEDY)[0].prompt is None


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"content": "hi"}], r"messages\[0\] needs a 'role'"),
        ([{"role": "", "content": "hi"}], r"messages\[0\] needs a 'role'"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\] \(user\) has no"),
        ([{"role": "user", "content": 5}], r"'content' must be a string or a list of text"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "only text is served",
        ),
        (["hi"], r"messages\[0\] must be a dict"),
        ([], "messages is empty"),
        ("hi", "messages must be a list"),
        ([[{"role": "user", "content": "a"}], [{"role": "user"}]], r"messages\[1\]\[0\]"),
        ([{"role": "user", "content": "a\ud800"}], r"messages is not valid Unicode: a lone surr"),
        ([{"role": "\udfff", "content": "a"}], "messages is not valid Unicode"),
    ],
)
def test_chat_messages_are_checked(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY)
    assert not llm.engine.has_unfinished()


def test_chat_forms(llm):
    (one,) = llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    assert one.prompt_token_ids == llm.encode("user: hi | assistant:")
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}
    ]
    assert llm.chat(parts, GREEDY)[0].token_ids == one.token_ids
    batch = llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]])
    assert len(batch) == 2 and batch[0].prompt_token_ids == one.prompt_token_ids


@pytest.mark.parametrize("model", [None, 12345, object(), 1.5])
def test_model_must_be_a_path_or_a_model(model):
    with pytest.raises(TypeError, match="LLM model must be a checkpoint directory"):
        LLM(model, use_tqdm=False)
    with pytest.raises(TypeError, match="LLMEngine model must be a model"):
        LLMEngine(model)
    with pytest.raises(ValueError, match="LLM model is an empty string"):
        LLM("", use_tqdm=False)


def test_tokenizer_directory_must_hold_a_tokenizer(checkpoint, tmp_path, llm):
    with pytest.raises(ValueError, match=r"LLM tokenizer=.*checkpoint directory does not exist"):
        LLM(checkpoint, tokenizer=str(tmp_path / "missing"), use_tqdm=False, **SIZES)
    with pytest.raises(ValueError, match=r"LLM tokenizer=.*holds no tokenizer files"):
        LLM(checkpoint, tokenizer=str(tmp_path), use_tqdm=False, **SIZES)
    with pytest.raises(ValueError, match=r"LLM tokenizer='not-cached/tok'.*local Hugging Face"):
        LLM(checkpoint, tokenizer="not-cached/tok", use_tqdm=False, **SIZES)
    other = LLM(checkpoint, tokenizer=checkpoint, use_tqdm=False, **SIZES)
    assert other.encode("abc") == llm.encode("abc")


def test_use_tqdm_of_llm_and_of_generate(checkpoint, llm, capsys):
    capsys.readouterr()
    llm.generate("quiet", GREEDY)
    assert "Processed prompts" not in capsys.readouterr().err
    llm.generate("loud", GREEDY, use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err
    made = []

    def factory(**kwargs):
        from tqdm.auto import tqdm

        made.append(kwargs)
        return tqdm(**kwargs, disable=True)

    llm.generate(["a", "b"], GREEDY, use_tqdm=factory)
    assert made == [{"total": 2, "desc": "Processed prompts", "leave": False}]
    with pytest.raises(ValueError, match="use_tqdm must be a bool"):
        llm.generate("x", GREEDY, use_tqdm="yes")
    with pytest.raises(ValueError, match="use_tqdm must be a bool"):
        LLM(checkpoint, use_tqdm=None, **SIZES)
