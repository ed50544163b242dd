"""The one loader of the CUDA extension ``jax_tokenweave.kernel._tokenweave_ffi``, if it was built
(``ffi/``, when nvcc is present at install time), shared by the two parts it binds: the
collective (``ffi/collective/``: ``kernel._ffi``) and the attention (``ffi/attention/``:
``serving.attention.attention_kernel``). Importing it calls no CUDA function, so it loads on
CPU-only machines.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

try:
    from jax_tokenweave.kernel import _tokenweave_ffi as _module

    _IMPORT_ERROR: str | None = None
except ImportError as e:  # not built (no nvcc at install time) or broken
    _module = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"


def import_error() -> str | None:
    """Why the extension did not import (the ImportError text), or None."""
    return _IMPORT_ERROR


def get() -> ModuleType:
    """The extension module; RuntimeError (with the import error) where it is absent."""
    if _module is None:
        raise RuntimeError(f"the jax-tokenweave CUDA extension is not available ({_IMPORT_ERROR})")
    return _module


@functools.cache
def limits() -> dict[str, Any]:
    """The kernel's limits as the extension defines them: ``max_ranks``, ``min_ctas``,
    ``max_ctas`` (barrier variants), ``max_oneshot_ctas``, ``max_hidden``, ``hidden_multiple``,
    ``threads``, ``oneshot_buffers``, and ``algos`` (variant name -> the id the handlers take)."""
    return dict(get().limits())
