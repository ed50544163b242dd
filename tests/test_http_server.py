"""The OpenAI-compatible server (``python -m jax_tokenweave.serve``) as a subprocess on a free
localhost port, over a tiny checkpoint written here (a transformers Llama config, random
weights, a ``tokenizers`` tokenizer with a chat template), driven by the official ``openai``
client (sync and async, streamed and not) and by raw httpx for malformed input; plus the app
in-process for the bounded waiting queue. The server starts once for the file; the SIGTERM
test, which stops it, runs last."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hf_testutil import (
    CHAT_TEMPLATE,
    import_or_skip,
    make_hf_model,
    save_char_tokenizer,
    save_checkpoint,
)

from jax_tokenweave.serving import LLM, SamplingParams

import_or_skip("torch")
import_or_skip("transformers")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

# One server process and one in-process LLM for the whole file: end to end, slow on a CPU.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
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
STARTUP_S = 180


def flags(sizes: dict) -> list[str]:
    return [a for k, v in sizes.items() for a in (f"--{k.replace('_', '-')}", str(v))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = save_checkpoint(
        make_hf_model("llama", seed=23), str(tmp_path_factory.mktemp("http") / "tiny")
    )
    return save_char_tokenizer(path, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def llm(checkpoint):
    """The in-process reference: the same checkpoint and engine sizes as the server."""
    return LLM(checkpoint, tensor_parallel_size=2, use_tqdm=False, **SIZES)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """``(base url, process, log path)`` of a server started for this file."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jax_tokenweave.serve",
                checkpoint,
                "--tp",
                "2",
                "--port",
                str(port),
                "--served-model-name",
                MODEL,
                "--no-warmup",
                "--drain-timeout",
                "30",
                *flags(SIZES),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start: {log.read_text()[-3000:]}")
        time.sleep(0.3)
    yield url, proc, log
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(tokenweave_[^\s]+)\s+([-+\de.na]+)$", text, re.MULTILINE)
    }


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """The metrics once no request runs or waits and no KV block is in use."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (
            m["tokenweave_num_requests_running"],
            m["tokenweave_num_requests_waiting"],
            m["tokenweave_kv_blocks_in_use"],
        ) == (0, 0, 0):
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


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
    ("unknown model", {"model": "gpt-5", "prompt": "x"}, "model"),
    ("prompt beyond max_model_len", {"prompt": "y" * 200}, "prompt"),
    ("token id beyond the vocabulary", {"prompt": [1, 99999]}, "prompt"),
    ("too many logprobs", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("empty messages", {"messages": []}, "messages"),
    ("messages of the wrong type", {"messages": "hi"}, "messages"),
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


def test_a_full_waiting_queue_answers_429_never_hangs(llm):
    """In-process (the engine loop not started, so requests wait): beyond ``max_waiting``
    the answer is 429 at once; draining answers 503; cancelled requests leave nothing."""
    from jax_tokenweave.serve.app import build_app

    app = build_app(llm, model_name=MODEL, max_waiting=2)
    state = app.state.server
    body = {"model": MODEL, "prompt": "wait", "max_tokens": 4}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            waiting = [
                asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(2)
            ]
            while llm.engine.counts()[1] < 2:
                await asyncio.sleep(0.01)
            full = await asyncio.wait_for(c.post("/v1/completions", json=body), 10)
            state.engine.stop_accepting()
            draining = await asyncio.wait_for(c.post("/v1/completions", json=body), 10)
            health = await c.get("/health")
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            return full, draining, health

    full, draining, health = asyncio.run(main())
    assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
    assert draining.status_code == 503 and health.status_code == 503
    assert not llm.engine.request_ids() and llm.engine.num_blocks_in_use == 0
    assert state.metrics.requests.labels("rejected")._value.get() == 2


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
    assert "jax-tokenweave: stopped" in log.read_text()
