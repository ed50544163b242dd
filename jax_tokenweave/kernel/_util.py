"""Small helpers shared by every part of the package; imports nothing from it."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def ceil_div(a: T, b: int) -> T:
    """``ceil(a / b)`` in integer arithmetic, for ``b > 0``: ``-(-a // b)``.

    ``a`` may be a Python int or an integer NumPy / JAX array (element-wise, same dtype)."""
    return -(-a // b)
