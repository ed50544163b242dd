"""Small helpers shared by every part of the package; imports nothing from it."""

from __future__ import annotations

from typing import Protocol, TypeVar

T = TypeVar("T", bound="_FloorDivisible")


class _FloorDivisible(Protocol):
    """What :func:`ceil_div` needs of its ``a``: an int, or an integer NumPy / JAX array."""

    def __floordiv__(self: T, other: int, /) -> T: ...
    def __neg__(self: T) -> T: ...


def ceil_div(a: T, b: int) -> T:
    """``ceil(a / b)`` in integer arithmetic, for ``b > 0``: ``-(-a // b)``.

    ``a`` may be a Python int or an integer NumPy / JAX array (element-wise, same dtype)."""
    return -(-a // b)
