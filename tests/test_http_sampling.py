"""vLLM's sampling options through the OpenAI-compatible app, driven in-process by the official
``openai`` client (and raw httpx) over an ASGI transport: penalties, ``min_tokens``,
``logit_bias`` (string keys, clamped to [-100, 100]) give the offline API's tokens;
``echo`` prepends the prompt (its text, or its token ids decoded), streamed or not, with the
prompt's log-probabilities where ``logprobs`` is asked (vLLM's layout: None for the first
token); ``"max_tokens": null`` runs to the model's length; the protocol's mapping refuses bad
values naming the field."""

from __future__ import annotations

import pytest
from hf_testutil import TINY_ENGINE, require_server_stack, save_tiny_llama, serve_in_process

from jax_tokenweave.serving import LLM, SamplingParams

require_server_stack()

MODEL = "tiny"
SIZES = dict(
    TINY_ENGINE,
    max_model_len=64,
    num_blocks=96,
)
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
CLIENT = dict(temperature=0.0, max_tokens=8)  # with extra_body={"ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("sampling") / "tiny", seed=17)
    return LLM(path, use_tqdm=False, **SIZES)


def serve(llm, work):
    """``await work(client, raw)`` against the app over ``llm`` (``hf_testutil``)."""
    return serve_in_process(llm, work, MODEL)


def test_penalties_min_tokens_and_logit_bias_equal_the_offline_api(llm):
    # (the openai client's keywords, vLLM's extensions in the body, SamplingParams' fields)
    options = [
        (dict(presence_penalty=1.5, frequency_penalty=0.5), {}, {}),
        (dict(frequency_penalty=-1.0), {"repetition_penalty": 1.7}, {}),
        (dict(logit_bias={"60": 4.0, "61": -3.0}), {"repetition_penalty": 1.2}, {}),
        ({}, {"min_tokens": 5, "ignore_eos": False, "stop_token_ids": [70]}, {}),
    ]

    async def work(client, raw):
        return [
            await client.completions.create(
                model=MODEL,
                prompt="penalized text",
                extra_body={"ignore_eos": True, **body},
                **CLIENT,
                **kw,
            )
            for kw, body, _ in options
        ]

    got = serve(llm, work)
    for (kw, body, _), out in zip(options, got, strict=True):
        fields = {**GREEDY, **kw, **body}
        if "logit_bias" in fields:
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        (want,) = llm.generate("penalized text", SamplingParams(**fields))
        assert out.choices[0].text == want.outputs[0].text, (kw, body)
        assert out.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_logit_bias_is_clamped_and_checked(llm):
    async def work(client, raw):
        strong = await client.completions.create(
            model=MODEL,
            prompt="bias",
            logit_bias={"60": 500},
            extra_body={"ignore_eos": True},
            **CLIENT,
        )
        bad = await raw.post("/v1/completions", json={"prompt": "x", "logit_bias": {"sixty": 1.0}})
        outside = await raw.post(
            "/v1/completions", json={"prompt": "x", "logit_bias": {"99999": 1.0}}
        )
        penalty = await raw.post("/v1/completions", json={"prompt": "x", "presence_penalty": 3})
        return strong, bad, outside, penalty

    strong, bad, outside, penalty = serve(llm, work)
    assert strong.choices[0].text == llm.tokenizer.decode([60]) * 8
    for response, param in (
        (bad, "logit_bias"),
        (outside, "logit_bias"),
        (penalty, "presence_penalty"),
    ):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_echo_with_prompt_logprobs_streamed_or_not(llm):
    prompt = "echo me"

    async def work(client, raw):
        plain = await client.completions.create(
            model=MODEL, prompt=prompt, echo=True, extra_body={"ignore_eos": True}, **CLIENT
        )
        scored = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            echo=True,
            logprobs=2,
            extra_body={"ignore_eos": True},
            **CLIENT,
        )
        ids = llm.encode(prompt)
        by_ids = await client.completions.create(
            model=MODEL, prompt=ids, echo=True, extra_body={"ignore_eos": True}, **CLIENT
        )
        chunks = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            echo=True,
            logprobs=2,
            stream=True,
            extra_body={"ignore_eos": True},
            **CLIENT,
        )
        streamed = [c async for c in chunks]
        return plain, scored, by_ids, streamed

    plain, scored, by_ids, streamed = serve(llm, work)
    params = SamplingParams(**GREEDY, logprobs=2, prompt_logprobs=2)
    (want,) = llm.generate(prompt, params)
    assert plain.choices[0].text == prompt + want.outputs[0].text
    assert by_ids.choices[0].text == llm.tokenizer.decode(llm.encode(prompt)) + want.outputs[0].text
    lp = scored.choices[0].logprobs
    ids = want.prompt_token_ids + want.outputs[0].token_ids
    assert lp.tokens == [llm.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    prompt_lps = want.prompt_logprobs[1:]
    for i, entry in enumerate(prompt_lps, start=1):
        token = want.prompt_token_ids[i]
        assert lp.token_logprobs[i] == pytest.approx(entry[token].logprob, abs=1e-5)
        ranked = {llm.tokenizer.decode([t]) for t, e in entry.items() if e.rank in (1, 2)}
        assert set(lp.top_logprobs[i]) >= ranked
    n_prompt = len(want.prompt_token_ids)
    for j, e in enumerate(want.outputs[0].token_logprobs):
        assert lp.token_logprobs[n_prompt + j] == pytest.approx(e.logprob, abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len("".join(lp.tokens[:n_prompt]))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == scored.choices[0].text
    first = streamed[0].choices[0].logprobs
    assert first.tokens[:n_prompt] == lp.tokens[:n_prompt]
    assert first.token_logprobs[:n_prompt] == pytest.approx(lp.token_logprobs[:n_prompt], abs=1e-6)


def test_max_tokens_null_runs_to_the_models_length(llm):
    async def work(client, raw):
        null = await raw.post(
            "/v1/completions",
            json={"prompt": "abc", "max_tokens": None, "temperature": 0, "ignore_eos": True},
        )
        absent = await raw.post(
            "/v1/completions", json={"prompt": "abc", "temperature": 0, "ignore_eos": True}
        )
        return null.json(), absent.json()

    null, absent = serve(llm, work)
    prompt_tokens = len(llm.encode("abc"))
    assert null["usage"]["completion_tokens"] == SIZES["max_model_len"] - prompt_tokens
    assert null["choices"][0]["finish_reason"] == "length"
    assert absent["usage"]["completion_tokens"] == 16  # the completions API's default


def test_protocol_maps_the_fields():
    from jax_tokenweave.openai_server import protocol as P

    req = P.CompletionRequest(
        prompt="x",
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.3,
        min_tokens=3,
        logit_bias={"5": 250.0, "6": -1000.0, "7": 2.5},
        echo=True,
        logprobs=3,
    )
    params = P.sampling_params(req, None, req.logprobs, req.logprobs)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.repetition_penalty == 1.3 and params.min_tokens == 3
    assert dict(params.logit_bias) == {5: 100.0, 6: -100.0, 7: 2.5}
    assert params.max_tokens is None and params.prompt_logprobs == 3 and params.logprobs == 3
    with pytest.raises(P.BadRequest) as err:
        P.sampling_params(P.CompletionRequest(prompt="x", logit_bias={"a": 1.0}), 4, None)
    assert err.value.param == "logit_bias"
    with pytest.raises(P.BadRequest) as err:
        P.sampling_params(P.CompletionRequest(prompt="x", repetition_penalty=0.0), 4, None)
    assert err.value.param == "repetition_penalty"
