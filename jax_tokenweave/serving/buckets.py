"""Shape buckets: every jitted step sees one of a few static shapes, so requests of new lengths
reuse compiled code. Lengths and batch sizes round up to powers of two (with a floor)."""

from __future__ import annotations


def next_pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two ``>= max(n, minimum)``."""
    if n < 0:
        raise ValueError(f"need n >= 0, got {n}")
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()


def length_bucket(length: int, minimum: int = 16) -> int:
    """Padded prompt length for a prompt of ``length`` tokens: ``next_pow2(length, minimum)``."""
    if length < 1:
        raise ValueError(f"a prompt needs at least one token, got length {length}")
    return next_pow2(length, minimum)


def batch_bucket(size: int, maximum: int) -> int:
    """Padded batch size for ``size`` requests: ``min(next_pow2(size), maximum)``."""
    if not 1 <= size <= maximum:
        raise ValueError(f"batch size {size} not in 1..{maximum}")
    return min(next_pow2(size), maximum)
