"""The OpenAI-compatible server (``python -m jax_tokenweave.serve``) as a subprocess on a free
localhost port, over a tiny checkpoint written here (a transformers Llama config, random
weights, a ``tokenizers`` tokenizer with a chat template), driven by the official ``openai``
client (sync and async, streamed and not) and by raw httpx for malformed input; plus the app
in-process for the bounded waiting queue. The server starts once for the file; the SIGTERM
test, which stops it, runs last."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import numpy as np
import pytest
from hf_testutil import CHAT_TEMPLATE, import_or_skip, save_tiny_llama

from jax_tokenweave.serving import LLM, SamplingParams

import_or_skip("torch")
import_or_skip("transformers")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from http_testutil import (  # noqa: E402  (needs httpx)
    flags,
    is_openai_error,
    metrics,
    start_server,
    stop,
    wait_idle,
)

# One server process and one in-process LLM for the whole file: end to end, slow on a CPU.
pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
SIZES = dict(
    max_num_batched_tokens=64,
    max_num_seqs=16,
    prefill_tile=16,
    block_size=16,
    key_chunk=64,
    split_threshold=32,
    collective="xla",
    max_model_len=128,
    num_blocks=160,
)
MAX_WAITING = 1024  # the server's default --max-waiting


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("http") / "tiny", 23, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def llm(checkpoint):
    """The in-process reference: the same checkpoint and engine sizes as the server."""
    return LLM(checkpoint, tensor_parallel_size=2, use_tqdm=False, **SIZES)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """``(base url, process, log path)`` of a server started for this file."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = [checkpoint, "--tp", "2", "--served-model-name", MODEL, "--no-warmup"]
    url, proc = start_server([*args, "--drain-timeout", "30", *flags(SIZES)], log)
    yield url, proc, log
    stop(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def test_startup_line_models_and_health(server, client):
    url, _, log = server
    line = next(x for x in log.read_text().splitlines() if "jax-tokenweave: serving" in x)
    assert f"'{MODEL}'" in line and "TP 2" in line and url in line and "max_model_len 128" in line
    (card,) = client.models.list().data
    assert card.id == MODEL
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_greedy_completions_and_chat_equal_llm_generate(client, llm):
    prompts = ["Hello, world", "The cat sat", "abc"]
    want = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    for prompt, w in zip(prompts, want, strict=True):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
        assert got.choices[0].text == w.outputs[0].text
        assert got.choices[0].finish_reason == w.outputs[0].finish_reason
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
            len(w.prompt_token_ids),
            len(w.outputs[0].token_ids),
        )
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    many = client.completions.create(
        model=MODEL, prompt=[prompts[0], prompts[1]], max_tokens=10, temperature=0, n=2
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices] == [want[0].outputs[0].text] * 2 + [
        want[1].outputs[0].text
    ] * 2
    assert many.usage.prompt_tokens == len(want[0].prompt_token_ids) + len(want[1].prompt_token_ids)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    (chat_want,) = llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == chat_want.outputs[0].text
    assert chat.usage.prompt_tokens == len(chat_want.prompt_token_ids)
    assert chat.usage.completion_tokens == len(chat_want.outputs[0].token_ids)


def test_streamed_chunks_concatenate_to_the_non_streamed_text(client, server):
    kw = dict(model=MODEL, max_tokens=12, temperature=0)
    full = client.completions.create(prompt="Stream me", **kw)
    chunks = list(
        client.completions.create(
            prompt="Stream me", stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[
        0
    ].finish_reason
    messages = [{"role": "user", "content": "tell me"}]

    async def chat_both():
        aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)
        whole = await aclient.chat.completions.create(messages=messages, **kw)
        parts = [
            c
            async for c in await aclient.chat.completions.create(
                messages=messages, stream=True, stream_options={"include_usage": True}, **kw
            )
        ]
        return whole, parts

    whole, parts = asyncio.run(chat_both())
    assert parts[0].choices[0].delta.role == "assistant"
    assert (
        "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        == whole.choices[0].message.content
    )
    assert parts[-1].choices == [] and parts[-1].usage == whole.usage
    raw = httpx.post(server[0] + "/v1/completions", json={**kw, "prompt": "x", "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_logprobs(client, llm):
    got = client.completions.create(
        model=MODEL, prompt="Odds", max_tokens=5, temperature=0, logprobs=2
    )
    lp = got.choices[0].logprobs
    (want,) = llm.generate(
        "Odds", SamplingParams(temperature=0.0, max_tokens=5, logprobs=2), use_tqdm=False
    )
    assert len(lp.tokens) == got.usage.completion_tokens == len(want.token_ids)
    assert lp.token_logprobs == pytest.approx(
        [e.logprob for e in want.outputs[0].token_logprobs], abs=1e-4
    )
    assert all(len(t) == 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_prefix_cache_and_preemption_metrics(server, client):
    url = server[0]
    before = wait_idle(url)
    prompt = "a system prompt every request of this test repeats, then: hi"
    made = [
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        for _ in range(2)
    ]
    after = wait_idle(url)
    assert made[0].choices[0].text == made[1].choices[0].text
    n = made[0].usage.prompt_tokens
    delta = {k: after[k] - before[k] for k in before if "prefix_cache" in k}
    assert delta == {
        "tokenweave_prefix_cache_queries_total": 2 * n,
        "tokenweave_prefix_cache_hits_total": (n - 1) // 16 * 16,  # the second one's
    }
    assert after["tokenweave_kv_blocks_cached"] >= n // 16
    assert after["tokenweave_num_preemptions_total"] >= 0


def test_200_concurrent_requests_half_streamed(server, llm, rng):
    texts = [
        "".join(chr(int(c)) for c in rng.integers(97, 123, int(n)))
        for n in rng.integers(3, 30, 200)
    ]
    lengths = rng.integers(1, 9, 200).tolist()
    want = llm.generate(
        texts, [SamplingParams(temperature=0.0, max_tokens=m) for m in lengths], use_tqdm=False
    )

    async def one(aclient, i):
        kw = dict(model=MODEL, prompt=texts[i], max_tokens=lengths[i], temperature=0)
        if i % 2:
            stream = await aclient.completions.create(stream=True, **kw)
            return "".join([c.choices[0].text async for c in stream if c.choices])
        return (await aclient.completions.create(**kw)).choices[0].text

    async def main():
        aclient = openai.AsyncOpenAI(
            base_url=server[0] + "/v1",
            api_key="none",
            max_retries=0,
            timeout=120,
            http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=256)),
        )
        return await asyncio.wait_for(
            asyncio.gather(*(one(aclient, i) for i in range(200))), timeout=150
        )

    got = asyncio.run(main())
    assert got == [w.outputs[0].text for w in want]
    wait_idle(server[0])


def test_clients_that_disconnect_free_their_blocks(server):
    url = server[0]
    before = metrics(url)['tokenweave_requests_total{status="abort"}']

    async def leave_mid_stream(client, i):
        body = {
            "model": MODEL,
            "prompt": f"leave {i}",
            "max_tokens": 100,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    return  # closes the connection mid-stream

    async def leave_before_the_answer(client, i):
        body = {
            "model": MODEL,
            "prompt": f"gone {i}",
            "max_tokens": 110,
            "temperature": 0,
            "ignore_eos": True,
        }  # 110 steps: far longer than the timeout
        with pytest.raises(httpx.TimeoutException):
            await client.post(url + "/v1/completions", json=body, timeout=0.05)

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=128)) as c:
            await asyncio.gather(
                *(leave_mid_stream(c, i) for i in range(50)),
                *(leave_before_the_answer(c, i) for i in range(5)),
            )

    asyncio.run(main())
    after = wait_idle(url)
    assert after['tokenweave_requests_total{status="abort"}'] - before >= 50
    assert after["tokenweave_kv_blocks_total"] == SIZES["num_blocks"]


BAD = [
    ("invalid JSON", b'{"model": "tiny-llama", "prompt": ', None),
    ("wrong type", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("NaN temperature", b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ("negative temperature", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("top_p out of range", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("n below 1", {"prompt": "x", "n": 0}, "n"),
    ("max_tokens beyond the model", {"prompt": "x", "max_tokens": 1000}, "max_tokens"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("empty prompt list", {"prompt": []}, "prompt"),
    ("prompt beyond max_model_len", {"prompt": "y" * 200}, "prompt"),
    ("token id beyond the vocabulary", {"prompt": [1, 99999]}, "prompt"),
    ("too many logprobs", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("empty messages", {"messages": []}, "messages"),
    ("messages of the wrong type", {"messages": "hi"}, "messages"),
    ("stream_options without stream", {"prompt": "x", "stream_options": {}}, "stream_options"),
    ("one of several prompts beyond the vocabulary", {"prompt": [[1, 2], [3, 99999]]}, "prompt"),
    ("a lone surrogate", b'{"prompt": "x\\ud800"}', "prompt"),
]


@pytest.mark.parametrize(("case", "body", "param"), BAD, ids=[c for c, _, _ in BAD])
def test_bad_requests_get_400_naming_the_field(server, case, body, param):
    path = (
        "/v1/chat/completions"
        if isinstance(body, dict) and "messages" in body
        else "/v1/completions"
    )
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    response = httpx.post(server[0] + path, timeout=30, **kw)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"] == param and error["message"]


def test_a_bad_request_disturbs_no_one(server, client, llm):
    (want,) = llm.generate(
        "steady", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)
        good = aclient.completions.create(
            model=MODEL,
            prompt="steady",
            max_tokens=30,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        bad = [
            aclient.completions.create(model=MODEL, prompt="x", temperature=-1) for _ in range(5)
        ]
        return await asyncio.gather(good, *bad, return_exceptions=True)

    good, *bad = asyncio.run(main())
    assert good.choices[0].text == want.outputs[0].text
    assert all(isinstance(b, openai.BadRequestError) for b in bad)
    assert metrics(server[0])['tokenweave_requests_total{status="invalid"}'] >= 5


RAW_ERRORS = [
    ("unknown path", "GET", "/v1/nothing", None, 404),
    ("wrong method", "DELETE", "/v1/completions", None, 405),
    ("wrong method on health", "POST", "/health", b"{}", 405),
    ("not UTF-8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("very deep JSON", "POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400),
    ("validation", "POST", "/v1/completions", b'{"prompt": 5}', 400),
    ("unknown model id", "GET", "/v1/models/gpt-5", None, 404),
]


@pytest.mark.parametrize(
    ("case", "method", "path", "body", "status"), RAW_ERRORS, ids=[c[0] for c in RAW_ERRORS]
)
def test_every_error_status_in_openai_shape(server, case, method, path, body, status):
    headers = {"content-type": "application/json"}
    response = httpx.request(method, server[0] + path, content=body, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    assert is_openai_error(response.json(), status), response.text


def test_a_body_over_the_limit_is_413_unread(server):
    """Over the default ``--max-request-bytes`` (4 MiB): 413 in OpenAI's shape, from the
    ``content-length`` or, chunked, as the body passes the limit; the server goes on."""
    from jax_tokenweave.openai_server.errors import DEFAULT_MAX_REQUEST_BYTES as LIMIT

    body = b'{"prompt": "' + b"z" * LIMIT + b'"}'
    headers = {"content-type": "application/json"}
    sized = httpx.post(server[0] + "/v1/completions", content=body, headers=headers, timeout=60)

    def chunks():
        for i in range(0, len(body), 1 << 16):
            yield body[i : i + (1 << 16)]

    chunked = httpx.post(server[0] + "/v1/completions", content=chunks(), headers=headers)
    for response in (sized, chunked):
        assert response.status_code == 413 and is_openai_error(response.json(), 413)
        assert str(LIMIT) in response.json()["error"]["message"]
    assert "content-length" not in chunked.request.headers
    assert httpx.get(server[0] + "/health").status_code == 200


def test_health_answers_within_50ms_while_a_huge_prompt_is_refused(server):
    """A 3,000,000-character prompt (under the body limit) is refused as too long for the
    model without being tokenized; ``/health`` answers meanwhile within 50 ms (p99)."""
    url = server[0]
    body = json.dumps({"model": MODEL, "prompt": "y" * 3_000_000}).encode()
    answers, done = [], threading.Event()

    def refuse():
        with httpx.Client(timeout=60) as c:
            for _ in range(8):
                r = c.post(
                    url + "/v1/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                )
                answers.append((r.status_code, r.json()))
        done.set()

    latencies = []
    with httpx.Client(timeout=10) as c:
        c.get(url + "/health")  # connected before the clock starts
        poster = threading.Thread(target=refuse)
        poster.start()
        while not done.is_set():
            start = time.perf_counter()
            assert c.get(url + "/health").status_code == 200
            latencies.append(time.perf_counter() - start)
        poster.join()
    assert [status for status, _ in answers] == [400] * 8
    error = answers[0][1]["error"]
    assert error["param"] == "prompt" and "max_model_len" in error["message"]
    assert "3000000 characters" in error["message"]  # refused before it was tokenized
    assert len(latencies) >= 20
    assert np.percentile(latencies, 99) < 0.05, sorted(latencies)[-5:]


def test_models_retrieve(client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-5")
    assert caught.value.body["param"] == "model" and "gpt-5" in caught.value.body["message"]


def test_more_prompts_than_the_queue_takes_is_a_400_queueing_nothing(server, client):
    url = server[0]
    before = wait_idle(url)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=["a"] * (MAX_WAITING + 1), max_tokens=2)
    error = caught.value.body
    assert error["param"] == "prompt" and str(MAX_WAITING) in error["message"]
    after = wait_idle(url)
    for key in ('tokenweave_requests_total{status="abort"}', "tokenweave_prompt_tokens_total"):
        assert after[key] == before[key], key
    assert after['tokenweave_requests_total{status="invalid"}'] == (
        before['tokenweave_requests_total{status="invalid"}'] + 1
    )


UNSUPPORTED = [
    ("completions", {"suffix": "and the end"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"best_of": 2, "n": 3}, "best_of"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"min_p": 0.1}, "min_p"),
    ("chat", {"guided_json": {"type": "object"}}, "guided_json"),
    ("chat", {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ("completions", {"skip_special_tokens": False}, "skip_special_tokens"),
    ("completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
]


@pytest.mark.parametrize(("path", "extra", "param"), UNSUPPORTED, ids=[u[2] for u in UNSUPPORTED])
def test_unsupported_fields_get_400_naming_them(server, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2, **extra}
    if path == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    response = httpx.post(f"{server[0]}/v1/{path.replace('chat', 'chat/completions')}", json=body)
    assert response.status_code == 400 and is_openai_error(response.json(), 400)
    assert response.json()["error"]["param"] == param
    assert param in response.json()["error"]["message"]


def test_neutral_values_and_bookkeeping_fields_are_served(client):
    """Fields at values that ask for nothing (and OpenAI's bookkeeping fields) are served."""
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_tokens=2,
        response_format={"type": "text"},
        tool_choice="none",
        user="u1",
        metadata={"k": "v"},
        store=False,
        parallel_tool_calls=False,
    )
    assert chat.choices[0].finish_reason == "length"
    done = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, n=2, best_of=2, suffix=None
    )
    assert len(done.choices) == 2


def test_the_real_client_sees_the_unsupported_field_named(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "get_weather"}}],
        )
    assert caught.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ],
        )
    assert caught.value.body["param"] == "messages"
    assert "image_url" in caught.value.body["message"]


def test_errors_name_the_fields_as_the_client_sent_them(client):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=1000)
    error = caught.value.body
    assert error["param"] == "max_completion_tokens"
    assert "max_completion_tokens=1000" in error["message"] and "max_tokens=" not in (
        error["message"].replace("max_completion_tokens", "")
    )
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1000)
    assert caught.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, logprobs=True, top_logprobs=50
        )
    assert caught.value.body["param"] == "top_logprobs"
    assert "top_logprobs=50" in caught.value.body["message"]


def test_stop_token_ids(client, llm):
    (free,) = llm.generate(
        "Stop here", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    stop_id = free.outputs[0].token_ids[3]
    first = free.outputs[0].token_ids.index(stop_id)
    got = client.completions.create(
        model=MODEL,
        prompt="Stop here",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == first + 1


def test_a_full_waiting_queue_answers_429_never_hangs(llm):
    """In-process (the engine loop not started, so requests wait): beyond ``max_waiting``
    the answer is 429 at once, and a request's prompts are queued all or none; draining
    answers 503; cancelled requests leave nothing."""
    from jax_tokenweave.openai_server.app import build_app

    app = build_app(llm, model_name=MODEL, max_waiting=2)
    state = app.state.server
    body = {"model": MODEL, "prompt": "wait", "max_tokens": 4}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:

            async def queue_one():
                waiting.append(asyncio.ensure_future(c.post("/v1/completions", json=body)))
                while llm.engine.counts()[1] < len(waiting):
                    await asyncio.sleep(0.01)

            waiting: list[asyncio.Future] = []
            await queue_one()
            pair = await c.post("/v1/completions", json={**body, "prompt": ["a", "b"]})
            queued_after_pair = llm.engine.counts()[1]
            await queue_one()
            full = await asyncio.wait_for(c.post("/v1/completions", json=body), 10)
            state.engine.stop_accepting()
            draining = await asyncio.wait_for(c.post("/v1/completions", json=body), 10)
            health = await c.get("/health")
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            return pair, queued_after_pair, full, draining, health

    pair, queued_after_pair, full, draining, health = asyncio.run(main())
    assert pair.status_code == 429 and queued_after_pair == 1
    assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
    assert draining.status_code == 503 and health.status_code == 503
    for response in (pair, full, draining, health):
        assert is_openai_error(response.json(), response.status_code)
    assert not llm.engine.request_ids() and llm.engine.num_blocks_in_use == 0
    assert state.metrics.requests.labels("rejected")._value.get() == 3


def test_tokenizing_runs_off_the_event_loop(llm, monkeypatch):
    """In-process: while a prompt is tokenized or a chat rendered (held until ``/health`` has
    answered), the event loop answers ``/health``."""
    from jax_tokenweave.openai_server.app import build_app

    real, started, release = llm.tokenizer, threading.Event(), threading.Event()

    class HeldTokenizer:
        def __getattr__(self, name):
            return getattr(real, name)

        def encode(self, text, **kw):
            started.set()
            assert release.wait(10), "the event loop was held while tokenizing"
            return real.encode(text, **kw)

    monkeypatch.setattr(llm, "tokenizer", HeldTokenizer())
    app = build_app(llm, model_name=MODEL)
    requests = [  # each refused after tokenizing: max_tokens beyond max_model_len
        ("/v1/completions", {"prompt": "held", "max_tokens": 1000}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000},
        ),
    ]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            out = []
            for path, body in requests:
                started.clear()
                release.clear()
                post = asyncio.ensure_future(c.post(path, json=body))
                while not started.is_set():
                    await asyncio.sleep(0.005)
                health = await asyncio.wait_for(c.get("/health"), 5)
                release.set()
                out.append((health.status_code, (await post).status_code))
            return out

    assert asyncio.run(main()) == [(200, 400), (200, 400)]


def test_failures_answer_500_in_openai_shape(llm, monkeypatch):
    """In-process: a step that raises fails its requests with a 500 (streamed: an error
    event, then ``data: [DONE]``); an error in the server's own code is a 500 too."""
    from jax_tokenweave.openai_server import protocol
    from jax_tokenweave.openai_server.app import build_app

    app = build_app(llm, model_name=MODEL)
    state = app.state.server

    def broken_step():
        raise RuntimeError("the device fell over")

    def broken_check(req):
        raise KeyError("a bug")

    monkeypatch.setattr(llm.engine, "step", broken_step)
    body = {"model": MODEL, "prompt": "fail", "max_tokens": 4}

    async def main():
        state.engine.start()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
                plain = await asyncio.wait_for(c.post("/v1/completions", json=body), 30)
                streamed = await asyncio.wait_for(
                    c.post("/v1/completions", json={**body, "stream": True}), 30
                )
                monkeypatch.setattr(protocol, "check_supported", broken_check)
                internal = await c.post("/v1/completions", json=body)
        finally:
            state.engine.stop()
        return plain, streamed, internal

    plain, streamed, internal = asyncio.run(main())
    assert plain.status_code == 500 and is_openai_error(plain.json(), 500)
    assert "the device fell over" in plain.json()["error"]["message"]
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and is_openai_error(json.loads(events[-2]), 500)
    assert internal.status_code == 500 and is_openai_error(internal.json(), 500)
    assert "a bug" in internal.json()["error"]["message"]
    assert not llm.engine.request_ids() and llm.engine.num_blocks_in_use == 0


def test_sigterm_drains_and_exits(server):
    """Runs last: the request in flight at SIGTERM finishes; new ones are refused; exit 0."""
    url, proc, log = server
    body = {
        "model": MODEL,
        "prompt": "drain",
        "max_tokens": 100,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    texts = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and not texts:
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.5)
                with pytest.raises(httpx.HTTPError):  # no new connections
                    httpx.post(url + "/v1/completions", json=body, timeout=5).raise_for_status()
            if line:
                texts.append(line)
    chunks = [t for t in texts if t.startswith("data: {")]
    assert len(chunks) == 100 and texts[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in chunks[-1]
    assert proc.wait(60) == 0
    text = log.read_text()
    assert "jax-tokenweave: stopped" in text
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
