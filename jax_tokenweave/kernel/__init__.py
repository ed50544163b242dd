"""The fused AllReduce + residual + RMSNorm kernel and everything that runs it.

Modules: ``ops`` (``allreduce_rmsnorm``), ``_ffi`` (FFI targets, ``unavailable_reason``),
``_extension``, ``comm`` (``Communicator``), ``comm_ipc``, ``policy``, ``loopback``, ``_util``.
Imports nothing above it; names load lazily (no JAX, no extension on import). See
docs/KERNEL.md#kernel.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "allreduce_rmsnorm": "jax_tokenweave.kernel.ops",
    "unavailable_reason": "jax_tokenweave.kernel._ffi",
    "CommFailed": "jax_tokenweave.kernel.comm",
    "CommSettings": "jax_tokenweave.kernel.comm",
    "Communicator": "jax_tokenweave.kernel.comm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
