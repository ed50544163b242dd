"""What a request gives back: the final :class:`RequestOutput`, the :class:`StreamDelta` of each
step, and the incremental text of a request (:class:`TextState`: detokenization, stop strings).

Text is ``tokenizer.decode(token_ids, skip_special_tokens=True)`` of the new tokens, cut before
the first stop string (``SamplingParams.stop``). A stream holds back the last characters that
could still turn out to be the start of a stop string, and a trailing incomplete character
(``"\\ufffd"``), until later tokens or the end decide them; so the stream's text deltas add up
to the final text, and its token ids to the final token ids.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (no temperature, no processors), the ``top``
    most likely tokens as ``(token id, logprob)``, most likely first, and its ``rank`` where
    known (prompt tokens: 1 + the tokens more likely)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclasses.dataclass
class RequestMetrics:
    """Times (``time.perf_counter()`` seconds) of a request's arrival, first new token and end."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def tpot(self, num_tokens: int) -> float | None:
        """Time per output token after the first (None with fewer than two tokens)."""
        if self.finish_time is None or self.first_token_time is None or num_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (num_tokens - 1)


@dataclasses.dataclass(frozen=True)
class Logprob:
    """vLLM's ``Logprob``: a token's log-probability, its rank in the model's distribution (1:
    the most likely; None where the token is not among the ``top`` computed) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a request (vLLM's ``CompletionOutput``). ``text`` is None without a
    tokenizer. ``finish_reason``: ``"stop"`` (a stop token or string), ``"length"``
    (``max_tokens`` made), ``"abort"`` (aborted) or ``"error"`` (failed inside a step:
    ``error`` says why); None while it runs. ``logprobs``: where asked for, vLLM's list (one
    per new token) of ``{token id: Logprob}``, the chosen token and the ``top`` most likely;
    ``token_logprobs`` the same as :class:`TokenLogprob`."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    token_logprobs: list[TokenLogprob] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A request's result, in vLLM's shape: ``prompt`` (None for token ids), its
    ``prompt_token_ids`` and one :class:`CompletionOutput` per sample (``n``) in ``outputs``;
    ``finished`` once every sample has. ``prompt_logprobs`` where asked: vLLM's list, None
    for the first prompt token, then ``{token id: Logprob}`` (the token, the top ones).
    ``text``, ``token_ids`` and ``finish_reason`` forward to ``outputs[0]``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def vllm_logprobs(entries: list[TokenLogprob], tokenizer: Any) -> list[dict[int, Logprob]]:
    """:class:`TokenLogprob` entries as vLLM's ``[{token id: Logprob}]`` (decoded where there
    is a tokenizer)."""
    decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: None)
    out = []
    for e in entries:
        entry = {
            tok: Logprob(lp, rank, decode(tok)) for rank, (tok, lp) in enumerate(e.top, start=1)
        }
        if e.token_id not in entry:
            entry = {e.token_id: Logprob(e.logprob, e.rank, decode(e.token_id)), **entry}
        out.append(entry)
    return out


@dataclasses.dataclass(frozen=True)
class StreamDelta:
    """What one step added to sample ``index`` of a request: new ``token_ids``, new ``text``
    ("" while held back; None without a tokenizer), their ``logprobs``; ``finish_reason`` on
    the sample's last delta (``"abort"`` / ``"error"`` deltas carry no tokens; ``error`` says
    why); ``request_finished`` on the request's last delta (every sample finished);
    ``prompt_logprobs`` (where asked) on sample 0's first (one per prompt token after the
    first)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str | None
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    index: int = 0
    request_finished: bool = False
    error: str | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def finished(self) -> bool:
        """Whether this sample finished (see ``request_finished`` for the request)."""
        return self.finish_reason is not None


class TextState:
    """The incremental text of one request (module docstring)."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.checked_from = 0  # stop strings must end past this many characters

    def update(self, token_ids: list[int], check: bool = True) -> bool:
        """Re-decode ``token_ids``; True where a stop string appeared (the text is cut). With
        ``check`` False (``min_tokens`` not reached) no stop string counts, neither now nor
        later where it ends in the text decoded now (vLLM's)."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if not check:
            self.text, self.checked_from = text, len(text)
            return False
        start = self.checked_from
        found = (text.find(s, max(start - len(s) + 1, 0)) for s in self.stop)
        cuts = [i for i in found if i >= 0]
        self.text = text[: min(cuts)] if cuts else text
        return bool(cuts)

    def delta(self, final: bool) -> str:
        """The text not streamed yet that is safe to stream (all of it when ``final``)."""
        end = len(self.text)
        if not final:
            end -= self.hold
            if self.text.endswith("\ufffd"):
                end = min(end, len(self.text) - 1)
        if end <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted : end], end
        return out
