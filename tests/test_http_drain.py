"""The server's start and end as a subprocess (``python -m jax_tokenweave.serve`` with warm-up
on, ``--drain-timeout 1``, ``--log-level info``, one request at a time): the warm-up's
progress lines, one log line per client that disconnects, and SIGTERM with more requests in
flight than the drain timeout lets finish: each one left ends with OpenAI's error (503: a
JSON body; a stream's error event, then ``data: [DONE]``), and the process exits within the
drain timeout + 1 s. The server starts once for the file; the SIGTERM test runs last."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import pytest
from hf_testutil import import_or_skip, save_tiny_llama

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

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
DRAIN_S = 1.0
REQUESTS = 48
RUNNING, WAITING = "tokenweave_num_requests_running", "tokenweave_num_requests_waiting"
FINISHED = 'tokenweave_requests_total{status="length"}'
SIZES = dict(
    max_num_batched_tokens=32,
    max_num_seqs=1,
    prefill_tile=16,
    block_size=16,
    key_chunk=64,
    split_threshold=32,
    collective="xla",
    max_model_len=128,
    num_blocks=40,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``(base url, process, log path)``: warm-up on, into an empty cache (``HOME``)."""
    home = tmp_path_factory.mktemp("home")
    checkpoint = save_tiny_llama(home / "tiny", seed=5)
    log = home / "server.log"
    args = [checkpoint, "--tp", "2", "--served-model-name", MODEL, "--log-level", "info"]
    url, proc = start_server(
        [*args, "--drain-timeout", str(DRAIN_S), *flags(SIZES)], log, env={"HOME": str(home)}
    )
    yield url, proc, log
    stop(proc)


def test_startup_reports_the_warm_up(server):
    text = server[2].read_text()
    start = re.search(r"jax-tokenweave: warm-up: (\d+) step programs to load or compile", text)
    done = re.search(
        r"jax-tokenweave: warm-up done: (\d+) step programs \((\d+) loaded, (\d+) compiled\) "
        r"in ([\d.]+) s",
        text,
    )
    assert start and done, text[-3000:]
    layouts = int(start.group(1))
    assert layouts > 1 and (int(done.group(1)), int(done.group(2)), int(done.group(3))) == (
        layouts,
        0,  # an empty cache: every program compiled
        layouts,
    )
    assert float(done.group(4)) > 0
    assert start.start() < done.start() < text.index("jax-tokenweave: serving")


def test_a_client_that_disconnects_is_one_log_line(server):
    url, _, log = server

    def lines() -> list[str]:
        return [x for x in log.read_text().splitlines() if "client disconnected" in x]

    before = len(lines())
    body = {"model": MODEL, "prompt": "gone", "max_tokens": 110, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))  # holds the one slot
        with pytest.raises(httpx.TimeoutException):  # queued behind the stream: never in time
            httpx.post(url + "/v1/completions", json=body, timeout=0.05)
    wait_idle(url)  # the stream left mid-way
    deadline = time.monotonic() + 10
    while len(lines()) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    new = lines()[before:]
    assert len(new) == 2, log.read_text()[-3000:]
    assert any("mid-stream" in x for x in new) and any("1 request(s) aborted" in x for x in new)
    assert "Traceback" not in log.read_text() and "CancelledError" not in log.read_text()


def test_the_drain_timeout_ends_requests_with_openai_errors(server):
    """Runs last: 48 requests of 120 tokens, one at a time, cannot finish in 1 s."""
    url, proc, log = server
    body = {"model": MODEL, "max_tokens": 120, "temperature": 0, "ignore_eos": True}

    async def raw_stream(c, i):
        lines = []
        async with c.stream(
            "POST", url + "/v1/completions", json={**body, "prompt": f"s{i}", "stream": True}
        ) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line]
        return lines

    kw = dict(model=MODEL, max_tokens=120, temperature=0, extra_body={"ignore_eos": True})

    async def client_stream(aclient, i):
        stream = await aclient.completions.create(prompt=f"c{i}", stream=True, **kw)
        return [chunk async for chunk in stream]

    async def plain(aclient, i):
        return await aclient.completions.create(prompt=f"p{i}", **kw)

    async def main():
        aclient = openai.AsyncOpenAI(
            base_url=url + "/v1",
            api_key="none",
            max_retries=0,
            timeout=60,
            http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=64)),
        )
        async with httpx.AsyncClient(timeout=60) as c:
            tasks = [  # the kinds interleaved, so that each has requests cut
                asyncio.ensure_future(
                    raw_stream(c, i)
                    if i % 4 == 0
                    else client_stream(aclient, i)
                    if i % 4 == 1
                    else plain(aclient, i)
                )
                for i in range(REQUESTS)
            ]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # every request in the engine (or done)
                m = await asyncio.to_thread(metrics, url)
                if sum(m[k] for k in (RUNNING, WAITING, FINISHED)) - finished_before >= REQUESTS:
                    break
                await asyncio.sleep(0.05)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            answered = time.monotonic() - signalled
        exited = await asyncio.to_thread(proc.wait, 30)
        return results, answered, time.monotonic() - signalled, exited

    finished_before = metrics(url)[FINISHED]
    results, answered, gone, status = asyncio.run(main())
    raw, streamed = results[0::4], results[1::4]
    plain_results = [r for i, r in enumerate(results) if i % 4 > 1]
    cut = {"raw": 0, "streamed": 0, "plain": 0}
    for lines in raw:
        assert isinstance(lines, list) and lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2][len("data: ") :])
        if "error" in last:
            cut["raw"] += 1
            assert is_openai_error(last, 503) and "drain timeout" in last["error"]["message"]
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    for result in streamed:
        if isinstance(result, openai.APIError):
            cut["streamed"] += 1
            assert "drain timeout" in result.message and result.body["code"] == 503
        else:
            assert result[-1].choices[0].finish_reason == "length", result
    for result in plain_results:
        if isinstance(result, openai.InternalServerError):
            cut["plain"] += 1
            assert result.status_code == 503 and is_openai_error(result.response.json(), 503)
        else:
            assert result.choices[0].finish_reason == "length", result
    assert min(cut.values()) >= 1 and sum(cut.values()) >= REQUESTS // 2, cut
    assert answered < DRAIN_S + 0.5
    assert status == 0 and gone < DRAIN_S + 1.0
    text = log.read_text()
    assert "jax-tokenweave: stopped" in text and "Traceback" not in text, text[-3000:]
