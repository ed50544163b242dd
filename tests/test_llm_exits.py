"""Every way out of ``LLM.generate``, ``chat``, ``stream`` and ``astream`` returns with the
call's requests finished and forgotten and their KV blocks free, with async scheduling on and
off: a normal end, a stop token, a stop string, a request failing inside a step, a failing step,
an interrupt, a stream closed early. Under async scheduling a request that stops at step n is
also in step n+1 (dispatched before step n's tokens arrived): that step is taken before the
call returns."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hf_testutil import (
    CHAT_TEMPLATE,
    TINY_ENGINE,
    import_or_skip,
    save_tiny_llama,
)

from jax_tokenweave.serving import LLM, RequestFailed, SamplingParams

import_or_skip("torch")
import_or_skip("transformers")

SIZES = dict(
    TINY_ENGINE,
    max_model_len=64,
    num_blocks=64,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("exits") / "tiny", 21, CHAT_TEMPLATE)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, checkpoint):
    return LLM(
        checkpoint,
        tensor_parallel_size=1,
        use_tqdm=False,
        async_scheduling=request.param,
        **SIZES,
    )


def idle(llm):
    """No request left, no step in flight, no KV block in use."""
    engine = llm.engine
    assert not engine.has_unfinished() and not engine.request_ids()
    assert not engine._inflight and not engine.scheduler.deferred
    assert engine.num_blocks_in_use == 0


def test_generate_returns_idle_after_every_kind_of_end(llm):
    (full,) = llm.generate("stop at a token", GREEDY)
    idle(llm)
    assert full.outputs[0].finish_reason == "length" and len(full.token_ids) == 10
    # a stop token made at the third step: the request is in the step dispatched after it
    stop_token = SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[full.token_ids[2]]
    )
    (out,) = llm.generate("stop at a token", stop_token)
    assert out.outputs[0].finish_reason == "stop"
    assert out.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[2]) + 1]
    idle(llm)
    # a stop string
    stop = full.text[3:5]
    (cut,) = llm.generate("stop at a token", dataclasses.replace(GREEDY, stop=(stop,)))
    assert cut.outputs[0].finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    idle(llm)
    # several requests, some stopping early, one longer
    outs = llm.generate(
        ["stop at a token", "another one", "stop at a token"],
        [stop_token, GREEDY, dataclasses.replace(GREEDY, stop=(stop,))],
    )
    assert [o.finish_reason for o in outs] == ["stop", "length", "stop"]
    idle(llm)
    (chat,) = llm.chat([{"role": "user", "content": "hi"}], stop_token)
    assert chat.finished
    idle(llm)


def test_streams_return_idle(llm):
    (full,) = llm.generate("streamed", GREEDY)
    stop_token = dataclasses.replace(GREEDY, stop_token_ids=(full.token_ids[1],))
    deltas = list(llm.stream("streamed", stop_token))
    assert deltas[-1].finish_reason == "stop"
    idle(llm)
    stream = llm.stream("streamed", GREEDY)
    next(stream)
    stream.close()
    idle(llm)

    async def consume(prompt, params):
        return [d async for d in llm.astream(prompt, params)]

    async def main():
        return await asyncio.gather(
            consume("streamed", stop_token), consume("other", GREEDY), consume("x", stop_token)
        )

    got = asyncio.run(main())
    assert got[0][-1].finish_reason == "stop" and got[1][-1].finish_reason == "length"
    idle(llm)


class FailingTokenizer:
    """The checkpoint's tokenizer, whose ``decode`` fails once a new token is ``bad``."""

    def __init__(self, inner):
        self.inner, self.bad, self.chat_template = inner, None, None

    def encode(self, text, **kw):
        return self.inner.encode(text, **kw)

    def decode(self, ids, **kw):
        if self.bad is not None and self.bad in list(ids):
            raise RuntimeError("decode exploded")
        return self.inner.decode(ids, **kw)


def test_failures_and_interrupts_return_idle(checkpoint, llm):
    (full,) = llm.generate("fail here", GREEDY)
    failing = LLM(
        checkpoint,
        tensor_parallel_size=1,
        use_tqdm=False,
        tokenizer=FailingTokenizer(llm.tokenizer),
        async_scheduling=llm.engine.config.async_scheduling,
        **SIZES,
    )
    failing.tokenizer.bad = full.token_ids[2]  # fails at the third new token
    with pytest.raises(RequestFailed, match="decode exploded"):
        failing.generate(["fail here", "fine"], GREEDY)
    idle(failing)
    with pytest.raises(RequestFailed, match="decode exploded"):
        list(failing.stream("fail here", GREEDY))
    idle(failing)
    failing.tokenizer.bad = None
    # a step that cannot be read back fails its requests
    fetch, calls = failing.engine.runner.fetch, {"n": 0}

    def broken(step, exc=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise exc or OverflowError("bad fetch")
        return fetch(step)

    failing.engine.runner.fetch = broken
    try:
        with pytest.raises(RequestFailed, match="bad fetch"):
            failing.generate(["fail here", "fine"], GREEDY)
        idle(failing)
        calls["n"] = 0
        failing.engine.runner.fetch = lambda step: broken(step, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            failing.generate(["fail here", "fine"], GREEDY)
        idle(failing)
    finally:
        failing.engine.runner.fetch = fetch
    assert failing.generate("fail here", GREEDY)[0].token_ids == full.token_ids
    idle(failing)
