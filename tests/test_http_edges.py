"""Hostile input to the OpenAI-compatible app, in-process over an ASGI transport (raw httpx and
the official ``openai`` client): text no tokenizer takes (lone surrogates), an unknown model
(404, as vLLM and OpenAI), chat content parts that are not text strings, out-of-vocabulary
``stop_token_ids`` named as such, chat's ``echo`` refused by name, and a stop string found at
the last allowed token (``"stop"``, as vLLM); after each the server is healthy with every KV
block free."""

from __future__ import annotations

import pytest
from hf_testutil import (
    CHAT_TEMPLATE,
    TINY_ENGINE,
    require_server_stack,
    save_tiny_llama,
    serve_in_process,
)

from jax_tokenweave.serving import LLM, SamplingParams

_, openai = require_server_stack()

MODEL = "tiny"
SIZES = dict(TINY_ENGINE, max_model_len=64, num_blocks=64)
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("edges") / "tiny", 31, CHAT_TEMPLATE)
    return LLM(path, use_tqdm=False, **SIZES)


def serve(llm, work):
    """``await work(client, raw)`` against the app over ``llm`` (``hf_testutil``); then no
    request is left and no KV block is in use."""
    out = serve_in_process(llm, work, MODEL)
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.allocator.num_free == llm.engine.config.num_blocks
    return out


def post_raw(path: str, text: str):
    """A work that posts ``text`` (JSON written by hand) to ``path``."""

    async def work(client, raw):
        headers = {"content-type": "application/json"}
        return await raw.post(path, content=text.encode(), headers=headers)

    return work


BAD = [
    ("completion surrogate", "/v1/completions", r'{"prompt": "a\ud800b"}', "prompt", "\\ud800"),
    (
        "completion surrogates in a list",
        "/v1/completions",
        r'{"prompt": ["ok", "\udc00"]}',
        "prompt",
        "lone surrogate",
    ),
    (
        "chat surrogate",
        "/v1/chat/completions",
        r'{"messages": [{"role": "user", "content": "hi \udfff"}]}',
        "messages",
        "not valid Unicode",
    ),
    (
        "stop_token_ids beyond the vocabulary",
        "/v1/completions",
        '{"prompt": "x", "stop_token_ids": [99999]}',
        "stop_token_ids",
        "stop_token_ids",
    ),
    (
        "a text part without text",
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
        "messages",
        "messages[0].content[0]",
    ),
    (
        "a text part of a number",
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
        "messages",
        "a string",
    ),
    (
        "chat echo",
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "hi"}], "echo": true}',
        "echo",
        "echo",
    ),
]


@pytest.mark.parametrize(("case", "path", "body", "param", "says"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_naming_the_field(llm, case, path, body, param, says):
    response = serve(llm, post_raw(path, body))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, 400)
    assert says in error["message"], error["message"]


def test_an_unknown_model_is_a_404_as_vllm(llm):
    async def work(client, raw):
        caught = []
        for call in (
            lambda: client.completions.create(model="gpt-5", prompt="x", max_tokens=2),
            lambda: client.chat.completions.create(model="gpt-5", messages=USER, max_tokens=2),
        ):
            with pytest.raises(openai.NotFoundError) as err:
                await call()
            caught.append(err.value)
        served = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        return caught, served

    caught, served = serve(llm, work)
    for err in caught:
        assert err.status_code == 404
        assert err.body["param"] == "model" and err.body["type"] == "not_found_error"
        assert "gpt-5" in err.body["message"] and MODEL in err.body["message"]
    assert served.choices[0].finish_reason == "length"


def test_a_stop_string_at_the_last_allowed_token_finishes_with_stop(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (full,) = llm.generate("late stop", greedy)
    stop = full.outputs[0].text[-1]
    cut = full.outputs[0].text.index(stop)
    body = dict(model=MODEL, prompt="late stop", max_tokens=cut + 1, temperature=0, stop=[stop])

    async def work(client, raw):
        whole = await client.completions.create(**body, extra_body={"ignore_eos": True})
        chunks = await client.completions.create(
            **body, stream=True, extra_body={"ignore_eos": True}
        )
        return whole, [c async for c in chunks]

    whole, chunks = serve(llm, work)
    choice = whole.choices[0]
    assert (choice.text, choice.finish_reason) == (full.outputs[0].text[:cut], "stop")
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_request_the_kv_pool_cannot_hold_names_the_prompt_or_max_tokens(tmp_path):
    """A pool of 3 blocks of 4 positions: a 13-token prompt can never fit whatever
    ``max_tokens`` (400 naming ``prompt``); a 9-token one with 8 new tokens cannot
    (``max_tokens``); nothing is queued."""
    path = save_tiny_llama(tmp_path / "tiny", 31, CHAT_TEMPLATE)
    small = LLM(path, use_tqdm=False, warmup=False, **{**SIZES, "num_blocks": 3})
    with pytest.raises(ValueError, match=r"its prompt alone needs 4 KV cache blocks"):
        small.generate([[5] * 13], SamplingParams(max_tokens=1))

    async def work(client, raw):
        return [
            await raw.post("/v1/completions", json={"prompt": [5] * tokens, "max_tokens": new})
            for tokens, new in ((13, 1), (9, 8))
        ]

    alone, both = serve(small, work)
    for response, param, says in (
        (alone, "prompt", "prompt alone"),
        (both, "max_tokens", "request needs 4"),
    ):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and says in error["message"], error


def test_stream_options_without_stream_is_refused(llm):
    """vLLM answers 400 to ``stream_options`` on a request that does not stream: it is not
    ignored."""

    async def work(client, raw):
        r = await raw.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream_options": {}},
        )
        return r.status_code, r.json()["error"]

    status, error = serve(llm, work)
    assert status == 400 and error["param"] == "stream_options"
    assert "only allowed with stream" in error["message"]


def test_several_prompts_name_the_one_at_fault(llm):
    """Of several prompts, the error says which one (``prompt[1]``), the field stays
    ``prompt``."""

    async def work(client, raw):
        out = []
        for prompt in ([[1, 2], [3, 10**6]], ["fine", ""], [[1], list(range(1, 70))]):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            r = await raw.post("/v1/completions", json=body)
            out.append((r.status_code, r.json()["error"]))
        return out

    for status, error in serve(llm, work):
        assert status == 400 and error["param"] == "prompt", error
        assert error["message"].startswith("prompt[1] "), error
