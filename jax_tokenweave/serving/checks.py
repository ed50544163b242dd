"""Checks of what a caller hands the serving loop; each raises ``ValueError`` naming the problem.

Integers are anything ``operator.index`` takes (Python and NumPy ints, integer JAX scalars),
never a bool or a float: ``1.7`` is refused, not truncated to ``1``.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np


def integer(value: Any, what: str) -> int:
    """``value`` as an int; ``ValueError`` naming ``what`` where it is no integer."""
    if isinstance(value, bool | np.bool_):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


def at_least(value: Any, minimum: int, what: str) -> int:
    """:func:`integer` ``>= minimum``."""
    out = integer(value, what)
    if out < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value!r}")
    return out


def prompts(values: Any, vocab_size: int) -> list[list[int]]:
    """A non-empty sequence of non-empty sequences of token ids in ``[0, vocab_size)``."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ValueError(f"prompts must be a sequence of token-id sequences, got {values!r}")
    out = []
    for i, prompt in enumerate(values):
        if isinstance(prompt, str | bytes) or not isinstance(prompt, Iterable):
            raise ValueError(f"prompt {i} must be a sequence of token ids, got {prompt!r}")
        ids = [integer(t, f"prompt {i}'s token id") for t in prompt]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
        out.append(ids)
    if not out:
        raise ValueError("no prompts: give at least one prompt")
    return out


def max_new_tokens(value: Any) -> int:
    """An integer >= 1."""
    return at_least(value, 1, "max_new_tokens")


def sampling(temperature: Any, top_p: Any) -> tuple[float, float]:
    """``temperature``: finite, >= 0 (0 = greedy); ``top_p``: in (0, 1]."""
    t, p = _real(temperature, "temperature"), _real(top_p, "top_p")
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                         f"{temperature!r}")
    if not 0 < p <= 1:  # NaN fails both comparisons
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return t, p


def eos_token_ids(value: Any) -> tuple[int, ...]:
    """One token id or a sequence of them (as Hugging Face's ``eos_token_id``) -> a tuple."""
    if value is None:
        return ()
    if isinstance(value, numbers.Integral) or getattr(value, "ndim", None) == 0:
        return (integer(value, "eos_token_ids"),)
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        return tuple(integer(t, "an eos token id") for t in value)
    raise ValueError(f"eos_token_ids must be a token id or a sequence of them, got {value!r}")


def _real(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a real number, got {value!r}")
    return float(value)
