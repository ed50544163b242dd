"""The prompt forms ``LLM`` takes, vLLM's, checked where they enter (``ValueError`` naming the
prompt and its key): a string, token ids, ``{"prompt": str}`` (vLLM's ``TextPrompt``),
``{"prompt_token_ids": [...]}`` (``TokensPrompt``; a ``"prompt"`` string beside them is kept
as the output's prompt text), one of them or a list; and chat conversations (a list of
``{"role": str, "content": str | [text parts]}`` messages, or a list of such lists)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

PROMPT_KEYS = ("prompt", "prompt_token_ids")


def one_prompt(prompt: Any, what: str) -> tuple[str | None, Any]:
    """``(text, token ids)`` of one prompt, one of the two None: the text for the tokenizer,
    the ids for ``checks.token_ids`` (``ValueError`` for a dict of the wrong shape)."""
    if isinstance(prompt, Mapping):
        unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
        if unknown:
            raise ValueError(
                f"{what} has keys this LLM does not take: {unknown} (give 'prompt', a string, "
                f"or 'prompt_token_ids', token ids)"
            )
        if not any(k in prompt for k in PROMPT_KEYS):
            raise ValueError(f"{what} is a dict without 'prompt' or 'prompt_token_ids'")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(
                f"{what}'s 'prompt' must be a string (token ids go in 'prompt_token_ids'), got "
                f"{type(text).__name__}"
            )
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, str | bytes):
                raise ValueError(
                    f"{what}'s 'prompt_token_ids' must be a sequence of token ids, got "
                    f"{type(ids).__name__} {ids!r:.40} (text goes in 'prompt')"
                )
            return text, ids
        if text is None:
            raise ValueError(f"{what}'s 'prompt' must be a string, got None")
        return text, None
    if isinstance(prompt, str):
        return prompt, None
    return None, prompt


def prompt_list(prompts: Any) -> list[Any]:
    """``prompts`` as a list of single prompts: one prompt (a string, a dict, token ids) is a
    list of one; ``ValueError`` for anything else or no prompt."""
    if isinstance(prompts, str | Mapping) or (
        isinstance(prompts, Sequence)
        and prompts
        and all(not isinstance(t, str | bytes | Sequence | np.ndarray | Mapping) for t in prompts)
    ):
        prompts = [prompts]  # one prompt
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence | Iterator):
        raise ValueError(
            f"prompts must be a string, token ids, a dict or a list of them, "
            f"got {type(prompts).__name__}"
        )
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts: give at least one prompt")
    return prompts


def conversations(messages: Any) -> list[tuple[str, list[dict[str, Any]]]]:
    """``messages`` (one conversation or a list of them, vLLM's ``LLM.chat``) as a list of
    ``(name, checked conversation)`` (:func:`check_messages`); the name (``"messages"`` or
    ``"messages[2]"``) is how errors call it."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise ValueError(
            f"messages must be a list of {{'role', 'content'}} dicts (or a list of such lists), "
            f"got {type(messages).__name__}"
        )
    if messages and all(isinstance(m, Sequence) and not isinstance(m, str) for m in messages):
        named = [(f"messages[{i}]", m) for i, m in enumerate(messages)]
        return [(name, check_messages(m, name)) for name, m in named]
    return [("messages", check_messages(messages, "messages"))]


def check_messages(messages: Any, what: str = "messages") -> list[dict[str, Any]]:
    """A non-empty conversation of messages with a ``role`` (a non-empty string) and a
    ``content`` (a string, or a list of ``{"type": "text", "text": str}`` parts, joined);
    other keys pass to the chat template. Returns the messages as new dicts."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise ValueError(f"{what} must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError(f"{what} is empty")
    out = []
    for i, message in enumerate(messages):
        where = f"{what}[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(
                f"{where} must be a dict with 'role' and 'content', got {message!r:.60}"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where} needs a 'role' (a non-empty string), got {role!r:.60}")
        if "content" not in message:
            raise ValueError(f"{where} ({role}) has no 'content'")
        out.append({**message, "content": _content(message["content"], where)})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        parts = []
        for part in content:
            if not (
                isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise ValueError(
                    f"{where}'s content parts must be {{'type': 'text', 'text': str}} (only "
                    f"text is served), got {part!r:.60}"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(
        f"{where}'s 'content' must be a string or a list of text parts, got {content!r:.60}"
    )
