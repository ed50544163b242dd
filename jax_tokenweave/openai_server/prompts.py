"""Requests in: a request's prompts checked and tokenized (:class:`Prompts`).

Tokenizing and rendering the chat template run in a worker thread (the routes call them through
``run_in_threadpool``), so a long prompt does not hold up the event loop. Text that cannot fit
``max_model_len`` tokens is refused before it is tokenized: a token covers at most
``longest token`` characters of the (normalized) text, so text longer than ``max_model_len x
longest token x`` :data:`NORMALIZER_SLACK` characters has more tokens than the model takes.
Where the tokenizer lists no vocabulary, every text is tokenized.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard

from jax_tokenweave.openai_server import protocol as P
from jax_tokenweave.serving import SamplingParams

NORMALIZER_SLACK = 4
"""Room for normalizers that compose characters (NFC: a letter and its marks become one)."""

# ``LLMEngine.check_request``'s messages -> the request field at fault (None: the prompt)
_CHECK_FIELDS = (
    ("prompt alone", None),
    ("logit_bias", "logit_bias"),
    ("stop_token_ids", "stop_token_ids"),
    ("logprobs=", "logprobs"),
    (": n=", "n"),
    ("stop strings", "stop"),
    ("KV cache blocks", "max_tokens"),
    ("max_tokens", "max_tokens"),
)


def prompt_name(index: int, count: int) -> str:
    """How errors name a completion's prompt: ``"prompt"``, or ``"prompt[2]"`` of several."""
    return "prompt" if count == 1 else f"prompt[{index}]"


def _token_ids(prompt: list[str] | list[int] | list[list[int]]) -> TypeGuard[list[int]]:
    """Whether a completion request's list ``prompt`` is one prompt's token ids (the request
    model's lists hold one kind of item)."""
    return bool(prompt) and isinstance(prompt[0], int)


def longest_token(tokenizer: Any) -> int | None:
    """The most characters one token of ``tokenizer`` spells (added tokens included); None
    where it lists no vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    try:
        vocab = get_vocab() if callable(get_vocab) else None
    except Exception:  # a tokenizer object that cannot list its vocabulary
        return None
    return max((len(t) for t in vocab), default=None) if vocab else None


class Prompts:
    """Prompts of the requests to one server: ``llm`` (a ``serving.LLM``: its tokenizer,
    chat template and engine), ``model_name`` (the served name), ``max_waiting`` (the waiting
    queue's bound: more prompts in one request can never be queued)."""

    def __init__(self, llm: Any, model_name: str, max_waiting: int) -> None:
        self.llm = llm
        self.model_name = model_name
        self.max_waiting = max_waiting
        self.tokenizer = llm.tokenizer
        self.max_model_len: int = llm.engine.config.max_model_len
        longest = longest_token(self.tokenizer)
        self.max_chars = (
            None if longest is None else self.max_model_len * longest * NORMALIZER_SLACK
        )

    def check_model(self, model: str | None) -> None:
        """404 (vLLM's and OpenAI's) where ``model`` names a model this server does not serve."""
        if model is not None and model != self.model_name:
            raise P.BadRequest(
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                404,
            )

    def listed(self, req: P.CompletionRequest) -> list[str | list[int]]:
        """The prompts of ``req`` (text or token ids); only their number is checked here."""
        prompt = req.prompt
        prompts: list[Any] = [prompt] if isinstance(prompt, str) or _token_ids(prompt) else prompt
        if not prompts:
            raise P.BadRequest("prompt is empty", "prompt")
        if len(prompts) > self.max_waiting:
            raise P.BadRequest(
                f"prompt: {len(prompts)} prompts in one request; this server queues at most "
                f"{self.max_waiting} requests (--max-waiting), so they can never all be served: "
                "send them in several requests",
                "prompt",
            )
        return prompts

    def _check_length(self, chars: int, what: str, field: str) -> None:
        if self.max_chars is not None and chars > self.max_chars:
            raise P.BadRequest(
                f"{what} has {chars} characters, more tokens than this model's maximum context "
                f"length (max_model_len {self.max_model_len}) can hold",
                field,
            )

    def completion_prompts(
        self, prompts: Sequence[str | list[int]]
    ) -> list[tuple[str | None, list[int]]]:
        """``(text, token ids)`` of each of :meth:`listed`'s prompts (in a worker thread)."""
        out: list[tuple[str | None, list[int]]] = []
        for i, p in enumerate(prompts):
            what = prompt_name(i, len(prompts))
            if isinstance(p, str):
                if not p:
                    raise P.BadRequest(f"{what} is an empty string", "prompt")
                if self.tokenizer is None:
                    raise P.BadRequest("this model has no tokenizer: send token ids", "prompt")
                self._check_length(len(p), what, "prompt")
                try:
                    out.append((p, self.llm.encode(p, what)))
                except ValueError as err:  # text no tokenizer takes
                    raise P.BadRequest(str(err), "prompt") from None
            else:
                if not p:
                    raise P.BadRequest(f"{what} has an empty list of token ids", "prompt")
                out.append((None, list(p)))
        return out

    def chat_messages(self, req: P.ChatCompletionRequest) -> list[dict[str, Any]]:
        """The template's messages of ``req``: text parts of a content list joined, a message's
        other fields (``name``, ``tool_calls``, ...) passed on; other parts refused."""
        if not req.messages:
            raise P.BadRequest("messages is empty", "messages")
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                kinds = {part.get("type") for part in content} - {"text"}
                if kinds:
                    raise P.BadRequest(
                        f"messages[{i}].content: only text parts are supported, got "
                        f"{sorted(map(str, kinds))}",
                        "messages",
                    )
                for j, part in enumerate(content):
                    if not isinstance(part.get("text"), str):
                        raise P.BadRequest(
                            f"messages[{i}].content[{j}]: a text part's 'text' must be a string, "
                            f"got {part.get('text')!r:.40}",
                            "messages",
                        )
                content = "".join(part["text"] for part in content)
            messages.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
        self._check_length(sum(len(m["content"]) for m in messages), "messages", "messages")
        return messages

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` (:meth:`chat_messages`) rendered (in a worker thread)."""
        try:
            return self.llm.chat_prompt(messages)
        except ValueError as err:
            raise P.BadRequest(str(err), "messages") from None
        except Exception as err:  # the template refused the conversation
            raise P.BadRequest(f"messages: the chat template failed: {err}", "messages") from None

    def check_fits(
        self, ids: Sequence[int], params: SamplingParams, what: str, field: str | None = None
    ) -> None:
        """:class:`BadRequest` naming the field where the request cannot run; ``what``: the
        prompt in messages (``"prompt[2]"`` of several), ``field``: its field (default
        ``what``)."""
        field = field or what
        limit = self.max_model_len
        if len(ids) >= limit:
            raise P.BadRequest(
                f"{what} has {len(ids)} tokens; this model's maximum context "
                f"length (max_model_len) is {limit}",
                field,
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise P.BadRequest(
                f"max_tokens={params.max_tokens} beside a {len(ids)}-token "
                f"{what} exceeds max_model_len ({limit})",
                "max_tokens",
            )
        try:
            self.llm.engine.check_request(ids, params, what)
        except ValueError as err:
            text = str(err)
            param = next((name for key, name in _CHECK_FIELDS if key in text), None) or field
            raise P.BadRequest(text, param) from None
