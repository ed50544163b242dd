"""OpenAI's request and response schemas (the subset served here) as pydantic models, and the
mapping of a request's sampling fields to ``SamplingParams``.

Requests ignore fields they do not know (as vLLM's); a field with a value this server cannot
honour (``echo``, ``suffix``, penalties other than 0, ``best_of`` other than ``n``) is a
:class:`BadRequest` naming it. ``top_k`` and ``ignore_eos`` are vLLM's extensions.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jax_tokenweave.serving import SamplingParams


class BadRequest(ValueError):
    """A request the server refuses (400, or ``status``), naming the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` a string, a list of strings, token ids or a list
    of token-id lists; ``logprobs``: the top log-probabilities per token (0-20)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``; ``logprobs`` / ``top_logprobs`` as OpenAI's."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


StreamOptions.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jax-tokenweave"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


_FIELD = re.compile(r"SamplingParams\.(\w+)")


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    """The request's ``SamplingParams`` (``max_tokens`` resolved by the caller);
    :class:`BadRequest` naming the field for a value out of range."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise BadRequest(f"{name} is not supported (only 0)", name)
    kwargs: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs
    )
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    if req.stop is not None:
        kwargs["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    try:
        return SamplingParams(**kwargs)
    except ValueError as err:
        field = _FIELD.search(str(err))
        param = field.group(1) if field else None
        raise BadRequest(str(err).replace("SamplingParams.", ""), param) from None


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for ``status``."""
    kind = {
        400: "invalid_request_error",
        404: "not_found_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }.get(status, "server_error")
    return ErrorResponse(
        error=ErrorInfo(message=message, type=kind, param=param, code=status)
    ).model_dump()
