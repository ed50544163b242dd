"""Requests in, OpenAI's responses out: prompts from a request (checked, tokenized), a request's
deltas collected into choices (:class:`Collected`), responses and server-sent event chunks
(:class:`Renderer`).

Choice ``index`` is ``prompt index * n + sample index`` (OpenAI's order). ``usage`` counts each
prompt's tokens once and every sample's new tokens. A stream sends one chunk per delta (one
token), the chat stream's first chunk per choice carrying the assistant ``role``; with
``stream_options.include_usage`` a last chunk with no choices and the usage; then
``data: [DONE]``. A request that fails inside a step streams an error object before
``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, TypeGuard

from jax_tokenweave.serve import protocol as P
from jax_tokenweave.serving import SamplingParams, StreamDelta, TokenLogprob

# ``LLMEngine.check_request``'s messages -> the request field at fault (else the prompt)
_CHECK_FIELDS = (
    ("logprobs=", "logprobs"),
    (": n=", "n"),
    ("stop strings", "stop"),
    ("KV cache blocks", "max_tokens"),
    ("max_tokens", "max_tokens"),
)


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

    @classmethod
    async def of(cls, deltas: AsyncIterator[StreamDelta], n: int) -> Collected:
        out = cls([Sample() for _ in range(n)])
        async for d in deltas:
            s = out.samples[d.index]
            s.text.append(d.text or "")
            s.token_ids += d.token_ids
            s.logprobs += d.logprobs or ()
            if d.finish_reason:
                s.finish_reason = d.finish_reason
                if d.finish_reason == "error":
                    out.error = d.error
        return out


def _token_ids(prompt: list[str] | list[int] | list[list[int]]) -> TypeGuard[list[int]]:
    """Whether a completion request's list ``prompt`` is one prompt's token ids (the request
    model's lists hold one kind of item)."""
    return bool(prompt) and isinstance(prompt[0], int)


class Renderer:
    """Prompts and responses for one server (``state``: ``app.ServerState``)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.tokenizer = state.llm.tokenizer

    # -- requests ------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.state.model_name:
            raise P.BadRequest(
                f"model {model!r} does not exist; this server serves {self.state.model_name!r}",
                "model",
            )

    def completion_prompts(self, req: P.CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """``(text, token ids)`` of each prompt of ``req``."""
        prompt = req.prompt
        prompts: Sequence[str | int | list[int]] = (  # a string or token ids: one prompt
            [prompt] if isinstance(prompt, str) or _token_ids(prompt) else prompt
        )
        if not prompts:
            raise P.BadRequest("prompt is empty", "prompt")
        out: list[tuple[str | None, list[int]]] = []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise P.BadRequest("prompt is an empty string", "prompt")
                if self.tokenizer is None:
                    raise P.BadRequest("this model has no tokenizer: send token ids", "prompt")
                out.append((p, list(self.tokenizer.encode(p))))
            else:
                assert not isinstance(p, int)  # one list of token ids was made a list of one
                if not p:
                    raise P.BadRequest("prompt has an empty list of token ids", "prompt")
                out.append((None, list(p)))
        return out

    def chat_prompt(self, req: P.ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise P.BadRequest("messages is empty", "messages")
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(
                    part.get("text", "") for part in content if part.get("type") == "text"
                )
            messages.append({"role": m.role, "content": content or ""})
        try:
            return self.state.llm.chat_prompt(messages)
        except ValueError as err:
            raise P.BadRequest(str(err), "messages") from None
        except Exception as err:  # the template refused the conversation
            raise P.BadRequest(f"messages: the chat template failed: {err}", "messages") from None

    def check_fits(self, ids: Sequence[int], params: SamplingParams, what: str) -> None:
        """:class:`BadRequest` naming the field where the request cannot run."""
        limit = self.state.max_model_len
        if len(ids) >= limit:
            raise P.BadRequest(
                f"{what} has {len(ids)} tokens; this model's maximum context "
                f"length (max_model_len) is {limit}",
                what,
            )
        if len(ids) + params.max_tokens > limit:
            raise P.BadRequest(
                f"max_tokens={params.max_tokens} beside a {len(ids)}-token "
                f"{what} exceeds max_model_len ({limit})",
                "max_tokens",
            )
        try:
            self.state.llm.engine.check_request(ids, params, what)
        except ValueError as err:
            text = str(err)
            param = next((field for key, field in _CHECK_FIELDS if key in text), what)
            raise P.BadRequest(text, param) from None

    # -- responses -----------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _completion_logprobs(
        self, entries: Sequence[TokenLogprob], offset: int = 0
    ) -> P.CompletionLogprobs:
        out = P.CompletionLogprobs()
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
    ) -> Any:
        """The non-streamed response."""
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
                text="".join(s.text),
                finish_reason=s.finish_reason,
                logprobs=self._completion_logprobs(s.logprobs) if want_lp else None,
            )
            for p, r in enumerate(results)
            for i, s in enumerate(r.samples)
        ]
        return P.CompletionResponse(
            id=rid, created=P.now(), model=self.state.model_name, choices=choices, usage=usage
        )

    async def stream(
        self, rid: str, handles: Sequence[Any], params: SamplingParams, req: Any, chat: bool
    ) -> AsyncGenerator[str, None]:
        """Server-sent events of the request (module docstring)."""
        created, model, n = P.now(), self.state.model_name, params.n
        want_lp = params.logprobs is not None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        made, started = 0, set()
        offsets: dict[int, int] = {}  # choice index -> characters of text sent
        try:
            async for p, d in merge(self.state.engine, handles):
                if d.finish_reason == "error":
                    body = P.error_body(f"the request failed inside a step: {d.error}", 500)
                    yield f"data: {_json(body)}\n\n"
                    break
                index = p * n + d.index
                made += len(d.token_ids)
                lps = list(d.logprobs or ())
                if chat:
                    delta = P.DeltaMessage(content=d.text or "")
                    if index not in started:
                        started.add(index)
                        delta.role = "assistant"
                    chunk: Any = P.ChatCompletionChunk(
                        id=rid,
                        created=created,
                        model=model,
                        choices=[
                            P.ChatChunkChoice(
                                index=index,
                                delta=delta,
                                finish_reason=d.finish_reason,
                                logprobs=self._chat_logprobs(lps) if want_lp else None,
                            )
                        ],
                    )
                else:
                    offset = offsets.get(index, 0)
                    chunk = P.CompletionResponse(
                        id=rid,
                        created=created,
                        model=model,
                        choices=[
                            P.CompletionChoice(
                                index=index,
                                text=d.text or "",
                                finish_reason=d.finish_reason,
                                logprobs=self._completion_logprobs(lps, offset)
                                if want_lp
                                else None,
                            )
                        ],
                    )
                    offsets[index] = offset + len(d.text or "")
                yield f"data: {chunk.model_dump_json()}\n\n"
            else:
                if include_usage:
                    cls = P.ChatCompletionChunk if chat else P.CompletionResponse
                    last = cls(
                        id=rid,
                        created=created,
                        model=model,
                        choices=[],
                        usage=self._usage(handles, made),
                    )
                    yield f"data: {last.model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for h in handles:
                self.state.engine.abort(h)


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
