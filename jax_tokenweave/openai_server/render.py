"""OpenAI's responses out: a request's deltas collected into choices (:class:`Collected`),
responses and server-sent event chunks (:class:`Renderer`); the requests' side is
``openai_server.prompts``.

Choice ``index`` is ``prompt index * n + sample index`` (OpenAI's order). ``usage`` counts each
prompt's tokens once and every sample's new tokens. A stream sends one chunk per delta (one
token), the chat stream's first chunk per choice carrying the assistant ``role``; with
``stream_options.include_usage`` a last chunk with no choices and the usage; then
``data: [DONE]``. A request that fails inside a step (500), or that the drain timeout cuts
(503), streams OpenAI's error object before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from jax_tokenweave.openai_server import protocol as P
from jax_tokenweave.openai_server.async_engine import Cut, EngineFailed
from jax_tokenweave.serving import SamplingParams, StreamDelta, TokenLogprob


@dataclasses.dataclass
class Sample:
    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


@dataclasses.dataclass
class Collected:
    """One engine request's samples, collected from its deltas."""

    samples: list[Sample]
    error: str | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # where asked (echo)

    @classmethod
    async def of(cls, deltas: AsyncIterator[StreamDelta], n: int) -> Collected:
        out = cls([Sample() for _ in range(n)])
        async for d in deltas:
            if d.prompt_logprobs is not None:
                out.prompt_logprobs = d.prompt_logprobs
            s = out.samples[d.index]
            s.text.append(d.text or "")
            s.token_ids += d.token_ids
            s.logprobs += d.logprobs or ()
            if d.finish_reason:
                s.finish_reason = d.finish_reason
                if d.finish_reason == "error":
                    out.error = d.error
        return out


class Renderer:
    """Responses for one server (``state``: ``app.ServerState``)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.tokenizer = state.llm.tokenizer

    # -- responses -----------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])

    def echo_text(self, prompt: tuple[str | None, list[int]]) -> str:
        """The text ``echo`` prepends: the prompt's, or its token ids decoded (vLLM's)."""
        text, ids = prompt
        if text is not None or self.tokenizer is None:
            return text or ""
        return str(self.tokenizer.decode(ids))

    def _completion_logprobs(
        self,
        entries: Sequence[TokenLogprob],
        offset: int = 0,
        echo: tuple[list[int], Sequence[TokenLogprob] | None] | None = None,
    ) -> P.CompletionLogprobs:
        """OpenAI's completion logprobs of ``entries`` from text offset ``offset``; with
        ``echo`` (prompt ids, their log-probabilities) the prompt's tokens first, the first
        one's log-probability None (vLLM's)."""
        out = P.CompletionLogprobs()
        ids, scored = echo if echo is not None else ([], None)
        for i, token_id in enumerate(ids):
            e = scored[i - 1] if scored is not None and 0 < i <= len(scored) else None
            token = self._token(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(None if e is None else e.logprob)
            out.top_logprobs.append(None if e is None else {self._token(t): lp for t, lp in e.top})
            out.text_offset.append(offset)
            offset += len(token)
        for e in entries:
            token = self._token(e.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(e.logprob)
            out.top_logprobs.append({self._token(t): lp for t, lp in e.top})
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def _chat_logprobs(self, entries: Sequence[TokenLogprob]) -> P.ChoiceLogprobs:
        content = []
        for e in entries:
            token = self._token(e.token_id)
            content.append(
                P.TokenLogprobEntry(
                    token=token,
                    logprob=e.logprob,
                    bytes=list(token.encode()),
                    top_logprobs=[
                        P.TopLogprob(
                            token=(t := self._token(i)), logprob=lp, bytes=list(t.encode())
                        )
                        for i, lp in e.top
                    ],
                )
            )
        return P.ChoiceLogprobs(content=content)

    @staticmethod
    def _usage(handles: Sequence[Any], completion_tokens: int) -> P.Usage:
        prompt = sum(h.prompt_tokens for h in handles)
        return P.Usage(
            prompt_tokens=prompt,
            completion_tokens=completion_tokens,
            total_tokens=prompt + completion_tokens,
        )

    def response(
        self,
        rid: str,
        handles: Sequence[Any],
        results: Sequence[Collected],
        params: SamplingParams,
        chat: bool,
        echo: Sequence[tuple[str | None, list[int]]] | None = None,
    ) -> Any:
        """The non-streamed response; ``echo``: the prompts to prepend (completions)."""
        n, made = params.n, sum(len(s.token_ids) for r in results for s in r.samples)
        usage = self._usage(handles, made)
        want_lp = params.logprobs is not None
        if chat:
            chat_choices = [
                P.ChatChoice(
                    index=i,
                    message=P.AssistantMessage(content="".join(s.text)),
                    logprobs=self._chat_logprobs(s.logprobs) if want_lp else None,
                    finish_reason=s.finish_reason,
                )
                for i, s in enumerate(results[0].samples)
            ]
            return P.ChatCompletionResponse(
                id=rid,
                created=P.now(),
                model=self.state.model_name,
                choices=chat_choices,
                usage=usage,
            )
        choices = [
            P.CompletionChoice(
                index=p * n + i,
                text=("" if echo is None else self.echo_text(echo[p])) + "".join(s.text),
                finish_reason=s.finish_reason,
                logprobs=self._completion_logprobs(
                    s.logprobs, echo=None if echo is None else (echo[p][1], r.prompt_logprobs)
                )
                if want_lp
                else None,
            )
            for p, r in enumerate(results)
            for i, s in enumerate(r.samples)
        ]
        return P.CompletionResponse(
            id=rid, created=P.now(), model=self.state.model_name, choices=choices, usage=usage
        )

    def _chunk(
        self,
        rid: str,
        created: int,
        index: int,
        d: StreamDelta,
        sent: dict[int, int],
        want_lp: bool,
        chat: bool,
        echo: tuple[str, list[int], Sequence[TokenLogprob] | None] | None = None,
    ) -> Any:
        """The stream's chunk of delta ``d`` of choice ``index``; ``sent``: the characters of
        text each choice begun has sent (updated); ``echo`` (a completion choice's first
        chunk): the prompt's text, ids and log-probabilities, which the chunk starts with."""
        lps = list(d.logprobs or ())
        if chat:
            delta = P.DeltaMessage(content=d.text or "")
            if index not in sent:
                delta.role = "assistant"
            sent[index] = sent.get(index, 0) + len(d.text or "")
            return P.ChatCompletionChunk(
                id=rid,
                created=created,
                model=self.state.model_name,
                choices=[
                    P.ChatChunkChoice(
                        index=index,
                        delta=delta,
                        finish_reason=d.finish_reason,
                        logprobs=self._chat_logprobs(lps) if want_lp else None,
                    )
                ],
            )
        offset, head, first = sent.get(index, 0), "", None
        if echo is not None:
            head, first = echo[0], (echo[1], echo[2])
        sent[index] = offset + len(head) + len(d.text or "")
        return P.CompletionResponse(
            id=rid,
            created=created,
            model=self.state.model_name,
            choices=[
                P.CompletionChoice(
                    index=index,
                    text=head + (d.text or ""),
                    finish_reason=d.finish_reason,
                    logprobs=self._completion_logprobs(lps, offset, first) if want_lp else None,
                )
            ],
        )

    async def stream(
        self,
        rid: str,
        handles: Sequence[Any],
        params: SamplingParams,
        req: Any,
        chat: bool,
        echo: Sequence[tuple[str | None, list[int]]] | None = None,
    ) -> AsyncGenerator[str, None]:
        """Server-sent events of the request (module docstring); ``echo``: the prompts, sent
        first in each choice's first chunk (completions)."""
        created, n, made = P.now(), params.n, 0
        sent: dict[int, int] = {}  # choice index -> characters of text sent
        scored: dict[int, tuple[TokenLogprob, ...]] = {}  # prompt index -> its log-probabilities
        want_lp = params.logprobs is not None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        try:
            async for p, d in merge(self.state.engine, handles):
                if d.finish_reason == "error":
                    body = P.error_body(f"the request failed inside a step: {d.error}", 500)
                    yield f"data: {_json(body)}\n\n"
                    break
                made += len(d.token_ids)
                if d.prompt_logprobs is not None:  # sample 0's first delta: before the others'
                    scored[p] = d.prompt_logprobs
                index, head = p * n + d.index, None
                if echo is not None and index not in sent:  # the choice's first chunk
                    head = (self.echo_text(echo[p]), echo[p][1], scored.get(p))
                chunk = self._chunk(rid, created, index, d, sent, want_lp, chat, head)
                yield f"data: {chunk.model_dump_json()}\n\n"
            else:
                if include_usage:
                    cls = P.ChatCompletionChunk if chat else P.CompletionResponse
                    last = cls(
                        id=rid,
                        created=created,
                        model=self.state.model_name,
                        choices=[],
                        usage=self._usage(handles, made),
                    )
                    yield f"data: {last.model_dump_json()}\n\n"
        except (Cut, EngineFailed) as err:  # the drain timeout cut it / a step failed
            yield f"data: {_json(P.error_body(str(err), 503 if isinstance(err, Cut) else 500))}\n\n"
        finally:
            for h in handles:
                self.state.engine.abort(h)
        yield "data: [DONE]\n\n"


def _json(body: Any) -> str:
    return json.dumps(body)


async def merge(engine: Any, handles: Sequence[Any]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """``(prompt index, delta)`` of several requests as they come; leaving early aborts all."""
    if len(handles) == 1:
        async for d in engine.deltas(handles[0]):
            yield 0, d
        return
    queue: asyncio.Queue[tuple[int, StreamDelta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, handle: Any) -> None:
        try:
            async for d in engine.deltas(handle):
                queue.put_nowait((i, d))
        except Exception as err:
            queue.put_nowait((i, err))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
