"""``SamplingParams``: how one request is sampled and when it stops, checked when made.

Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` naming the field
(NaN or negative temperature, ``top_p`` outside (0, 1], ``top_k`` or ``seed`` beyond what the
step's int32 / uint32 arrays hold, ``n`` < 1, a non-integer ``max_tokens``, ...), so nothing a
caller passes can fail later inside a step. The object is frozen, so a checked one stays valid.
Unknown keywords raise ``TypeError`` naming ``SamplingParams`` (as any dataclass).

Defaults follow vLLM's: ``temperature=1.0`` (sampling), ``top_p=1``, ``top_k`` off, ``n=1``,
``max_tokens=16``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from jax_tokenweave.serving import checks

INT32_MAX = (1 << 31) - 1
UINT32_MAX = (1 << 32) - 1
FLOAT32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping (vLLM's names, meanings and defaults where they
    overlap); a bad field raises ``ValueError`` naming it. Each field's meaning is in its comment.
    """

    # Independent samples of the prompt (>= 1); sample i > 0 draws from its own random stream
    # derived from the request's seed.
    n: int = 1
    temperature: float = 1.0  # finite, >= 0 (default 1.0, as vLLM); 0 is greedy (argmax)
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # keep the top_k most likely tokens (0 or -1: all)
    # The request's own random stream (same seed, same tokens, whatever else is batched with
    # it); None: drawn from the engine's seed.
    seed: int | None = None
    # New tokens at most (>= 1); then the request finishes with "length". None: up to the
    # model's length (max_model_len less the prompt), as vLLM.
    max_tokens: int | None = 16
    # Tokens that finish it with "stop" (kept in token_ids), on top of the checkpoint's EOS ids
    # unless ignore_eos.
    stop_token_ids: tuple[int, ...] = ()
    # Strings that finish it with "stop"; the text is cut before the string (needs a tokenizer).
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # do not finish on the checkpoint's EOS ids
    # None, or how many of the most likely tokens' log-probabilities to return per new token
    # (0: only the chosen token's).
    logprobs: int | None = None
    # vLLM's penalties, applied to the logits on the device before sampling (greedy too):
    # presence / frequency in [-2, 2] over the new tokens (logits -= frequency * count +
    # presence * (count > 0)); repetition > 0 over the prompt and new tokens (logits > 0
    # divided by it, others multiplied). 0, 0, 1: off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Stop tokens (stop_token_ids and, unless ignore_eos, EOS) cannot be sampled, and stop
    # strings do not stop, before this many new tokens (<= max_tokens).
    min_tokens: int = 0
    # {token id: bias} added to the logits before sampling (a read-only dict once made).
    logit_bias: Mapping[int, float] | None = None
    # None, or how many of the most likely tokens' log-probabilities to return per prompt
    # token (vLLM's prompt_logprobs; 0: only the prompt token's).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # frozen
        set_("n", checks.at_least(self.n, 1, "SamplingParams.n"))
        set_("temperature", _real(self.temperature, "temperature"))
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX):
            raise ValueError(
                f"SamplingParams.temperature must be a finite number >= 0 "
                f"(0 = greedy), got {self.temperature!r}"
            )
        set_("top_p", _real(self.top_p, "top_p"))
        if not 0 < self.top_p <= 1:  # NaN fails both comparisons
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        set_("top_k", checks.integer(self.top_k, "SamplingParams.top_k"))
        if not -1 <= self.top_k <= INT32_MAX:
            raise ValueError(
                f"SamplingParams.top_k must be in [1, {INT32_MAX}], or 0 / -1 for "
                f"all tokens, got {self.top_k}"
            )
        if self.seed is not None:
            set_("seed", checks.integer(self.seed, "SamplingParams.seed"))
            if not 0 <= self.seed <= UINT32_MAX:
                raise ValueError(
                    f"SamplingParams.seed must be in [0, {UINT32_MAX}], got {self.seed}"
                )
        if self.max_tokens is not None:
            set_("max_tokens", checks.at_least(self.max_tokens, 1, "SamplingParams.max_tokens"))
            if self.max_tokens > INT32_MAX:
                raise ValueError(
                    f"SamplingParams.max_tokens must be <= {INT32_MAX} (or None), got "
                    f"{self.max_tokens}"
                )
        set_(
            "stop_token_ids",
            tuple(
                checks.at_least(t, 0, "SamplingParams.stop_token_ids entry")
                for t in _sequence(self.stop_token_ids, "stop_token_ids")
            ),
        )
        stop = (
            ()
            if self.stop is None
            else (self.stop,)
            if isinstance(self.stop, str)
            else _sequence(self.stop, "stop")
        )
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {s!r}")
        set_("stop", tuple(stop))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                set_(name, checks.at_least(getattr(self, name), 0, f"SamplingParams.{name}"))
        for name in ("presence_penalty", "frequency_penalty"):
            set_(name, _real(getattr(self, name), name))
            if not -2 <= getattr(self, name) <= 2:  # NaN fails
                raise ValueError(
                    f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)!r}"
                )
        set_("repetition_penalty", _real(self.repetition_penalty, "repetition_penalty"))
        if not 0 < self.repetition_penalty <= FLOAT32_MAX:  # NaN and inf fail
            raise ValueError(
                f"SamplingParams.repetition_penalty must be a finite number > 0 (1: off), got "
                f"{self.repetition_penalty!r}"
            )
        set_("min_tokens", checks.at_least(self.min_tokens, 0, "SamplingParams.min_tokens"))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens ({self.min_tokens}) must be <= max_tokens "
                f"({self.max_tokens})"
            )
        set_("logit_bias", _logit_bias(self.logit_bias))

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on (the engine keeps the request's token counts)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def biased(self) -> bool:
        """Whether some token's logit is biased (``logit_bias``, or ``min_tokens`` holding the
        stop tokens back)."""
        return bool(self.logit_bias) or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (``temperature == 0``)."""
        return self.temperature == 0.0

    def sample_seed(self, base: int, index: int) -> int:
        """The seed of sample ``index`` of a request seeded ``base``: ``base`` for the first,
        a stream derived from ``(base, index)`` for the others (so ``n`` samples differ)."""
        if index == 0:
            return base
        return int(np.random.SeedSequence([base, index]).generate_state(1)[0])


def _real(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"SamplingParams.{name} must be a real number, got {value!r}")
    return float(value)


class LogitBias(dict[int, float]):
    """A read-only ``{token id: bias}`` (``SamplingParams.logit_bias``, checked when made);
    it pickles and copies as a dict."""

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("SamplingParams.logit_bias is read-only: make new SamplingParams")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))


def _logit_bias(value: Any) -> Mapping[int, float] | None:
    """``logit_bias`` as a read-only ``{token id: finite float}`` (None for none)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(
            f"SamplingParams.logit_bias must be a dict of token id -> bias, got {value!r:.60}"
        )
    out = {}
    for token, bias in value.items():
        token = checks.at_least(token, 0, "SamplingParams.logit_bias token id")
        bias = _real(bias, f"logit_bias[{token}]")
        if not math.isfinite(bias) or abs(bias) > FLOAT32_MAX:
            raise ValueError(f"SamplingParams.logit_bias[{token}] must be finite, got {bias!r}")
        out[token] = bias
    return LogitBias(out)


def _sequence(value: Any, name: str) -> tuple[Any, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ValueError(f"SamplingParams.{name} must be a sequence, got {value!r}")
    return tuple(value)
