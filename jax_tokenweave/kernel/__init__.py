"""The fused AllReduce + residual + RMSNorm kernel and everything that runs it.

- ``ops``: ``allreduce_rmsnorm(partial, residual, weight, axis_name=, impl=)`` inside
  ``shard_map``, with ``impl`` ``xla`` | ``xla_rsag`` | ``ffi`` | ``auto``;
- ``_ffi``: the extension's XLA FFI targets, the synchronous call and the start/done pair, and
  ``unavailable_reason`` (why the fused kernel cannot run a call);
- ``_extension``: loads the CUDA extension (``_tokenweave_ffi``, built from ``ffi/``) if built;
- ``comm``: ``Communicator`` (one per mesh axis: workspace, settings, failure), ``CommSettings``;
- ``comm_ipc``: the cross-process workspace exchange (one process per GPU);
- ``policy`` (+ ``policy.json``): the kernel variant and CTA count per message size;
- ``loopback``: every rank of a group on one GPU (protocol tests);
- ``_util``: ``ceil_div``, the one helper every part of the package may import.

Imports nothing above it (``weave``, ``nn``, ...). The names below load lazily: importing this
package imports neither JAX nor the extension.
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
