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
from collections.abc import Iterable
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
    max_tokens: int = 16  # new tokens at most (>= 1); then the request finishes with "length"
    # Tokens that finish it with "stop" (kept in token_ids), on top of the checkpoint's EOS ids
    # unless ignore_eos.
    stop_token_ids: tuple[int, ...] = ()
    # Strings that finish it with "stop"; the text is cut before the string (needs a tokenizer).
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # do not finish on the checkpoint's EOS ids
    # None, or how many of the most likely tokens' log-probabilities to return per new token
    # (0: only the chosen token's).
    logprobs: int | None = None

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
        set_("max_tokens", checks.at_least(self.max_tokens, 1, "SamplingParams.max_tokens"))
        if self.max_tokens > INT32_MAX:
            raise ValueError(
                f"SamplingParams.max_tokens must be <= {INT32_MAX}, got {self.max_tokens}"
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
        if self.logprobs is not None:
            set_("logprobs", checks.at_least(self.logprobs, 0, "SamplingParams.logprobs"))

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


def _sequence(value: Any, name: str) -> tuple[Any, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ValueError(f"SamplingParams.{name} must be a sequence, got {value!r}")
    return tuple(value)
