"""OpenAI's request and response schemas (the subset served here) as pydantic models, and the
mapping of a request's sampling fields to ``SamplingParams``.

A field with a value this server cannot honour is a :class:`BadRequest` naming it
(:func:`check_supported`; :data:`UNSUPPORTED`: ``suffix``, ``tools``, ``tool_choice``,
``response_format`` other than text, audio, ... and vLLM's extensions it lacks; ``best_of`` other
than ``n``). Fields that ask for nothing an answer shows (``user``, ``metadata``, ``store``,
``service_tier``, ``parallel_tool_calls``) and fields neither OpenAI's nor vLLM's are ignored, as
vLLM ignores them. ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``repetition_penalty`` and
``min_tokens`` are vLLM's extensions; ``logit_bias`` values are clamped to [-100, 100], as vLLM.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictInt, Tag

from jax_tokenweave.serving import SamplingParams


class BadRequest(ValueError):
    """A request the server refuses (400, or ``status``), naming the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def _prompt_kind(value: Any) -> str:
    """Which form a completion's ``prompt`` takes, from its first item: only that form is
    validated (a union tries each, which takes ~0.2 s on 300k token ids)."""
    if isinstance(value, str):
        return "text"
    first = value[0] if isinstance(value, list) and value else None
    if isinstance(first, int | float) and not isinstance(first, bool):
        return "ids"
    return "id_lists" if isinstance(first, list) else "texts"


Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts")]
    | Annotated[list[StrictInt], Tag("ids")]
    | Annotated[list[list[StrictInt]], Tag("id_lists")],
    Discriminator(_prompt_kind),
]
"""A completion's ``prompt``: text, texts, token ids or lists of token ids."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept for check_supported

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
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` a string, a list of strings, token ids or a list
    of token-id lists; ``logprobs``: the top log-probabilities per token (0-20)."""

    prompt: Prompt
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


LOGIT_BIAS_LIMIT = 100.0
"""``logit_bias`` values are clamped to [-100, 100] (OpenAI's range; vLLM clamps too)."""


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's ``SamplingParams`` (``max_tokens`` resolved by the caller; None: up to
    the model's length); :class:`BadRequest` naming the field for a value out of range."""
    kwargs: dict[str, Any] = dict(
        n=req.n,
        max_tokens=max_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
    ):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    if req.logit_bias:
        kwargs["logit_bias"] = _logit_bias(req.logit_bias)
    if req.stop is not None:
        kwargs["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    if req.stop_token_ids:
        kwargs["stop_token_ids"] = req.stop_token_ids
    try:
        return SamplingParams(**kwargs)
    except ValueError as err:
        field = _FIELD.search(str(err))
        param = field.group(1) if field else None
        raise BadRequest(str(err).replace("SamplingParams.", ""), param) from None


_TEXT = (None, {"type": "text"})
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    # OpenAI's fields: name -> (the values this server honours, what the field asks for)
    "suffix": ((None, ""), "text after an insertion"),
    "tools": ((None, []), "function calling"),
    "tool_choice": ((None, "none"), "function calling"),
    "functions": ((None, []), "function calling"),
    "function_call": ((None, "none"), "function calling"),
    "response_format": (_TEXT, "JSON mode / structured outputs; only {'type': 'text'}"),
    "audio": ((None,), "audio output"),
    "modalities": ((None, ["text"]), "output other than text"),
    "prediction": ((None,), "predicted outputs"),
    "web_search_options": ((None,), "web search"),
    "reasoning_effort": ((None,), "a reasoning model's effort"),
    "verbosity": ((None,), "a reasoning model's verbosity"),
    # vLLM's extensions
    "use_beam_search": ((None, False), "beam search"),
    "length_penalty": ((None, 1.0), "beam search"),
    "min_p": ((None, 0.0), "min-p sampling"),
    **{
        f"guided_{k}": ((None,), "structured outputs")
        for k in ("json", "regex", "choice", "grammar", "decoding_backend", "whitespace_pattern")
    },
    "structured_outputs": ((None,), "structured outputs"),
    "allowed_token_ids": ((None,), "a restricted vocabulary"),
    "bad_words": ((None, []), "banned words"),
    "truncate_prompt_tokens": ((None,), "prompt truncation"),
    "include_stop_str_in_output": ((None, False), "the stop string in the text"),
    "skip_special_tokens": ((None, True), "special tokens in the text"),
    "spaces_between_special_tokens": ((None, True), "special tokens in the text"),
    "add_generation_prompt": ((None, True), "a chat prompt without the assistant's turn"),
    "continue_final_message": ((None, False), "continuing the last message"),
    "chat_template": ((None,), "another chat template"),
    "chat_template_kwargs": ((None, {}), "chat template arguments"),
    "documents": ((None, []), "documents for the chat template"),
}

CHAT_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    # vLLM's chat extensions (completions serve a field of the same name)
    "echo": ((None, False), "the last message prepended to the answer"),
}


def check_supported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """:class:`BadRequest` naming the first field of ``req`` this server cannot honour
    (:data:`UNSUPPORTED`, a chat's :data:`CHAT_UNSUPPORTED`, ``best_of`` other than ``n``,
    ``stream_options`` without ``stream``, as vLLM)."""
    refused = UNSUPPORTED
    if isinstance(req, ChatCompletionRequest):
        refused = {**UNSUPPORTED, **CHAT_UNSUPPORTED}
    for name, (honoured, what) in refused.items():
        value = getattr(req, name, None)
        if not any(
            value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in honoured
        ):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise BadRequest(
                f"{name} is not supported by this server ({what}); got {shown}: leave it out",
                name,
            )
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of < req.n:
        raise BadRequest(f"best_of ({best_of}) must be >= n ({req.n})", "best_of")
    if best_of is not None and best_of > req.n:
        raise BadRequest(
            f"best_of={best_of} > n={req.n} is not supported by this server (sampling more "
            "completions than returned): leave it out or set it to n",
            "best_of",
        )


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(
                f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                "logit_bias",
            ) from None
        if math.isnan(value):
            raise BadRequest(f"logit_bias[{key}] is NaN", "logit_bias")
        out[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, value))
    return out


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for ``status``."""
    kind = {
        400: "invalid_request_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }.get(status, "server_error")
    return ErrorResponse(
        error=ErrorInfo(message=message, type=kind, param=param, code=status)
    ).model_dump()
