"""Old names, kept for one release (removed in 0.4.0); each use warns (``DeprecationWarning``).

Old module paths (:data:`MOVED`, :func:`moved_module`), renamed attributes
(:func:`renamed_attribute`), renamed keywords (:func:`renamed_keyword`). Every message starts
with ``jax_tokenweave``. Imports nothing from the package; registers no import hook.
How the old paths resolve: docs/PACKAGE.md#_legacy.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")

MOVED: dict[str, str] = {
    "jax_tokenweave._extension": "jax_tokenweave.kernel._extension",
    "jax_tokenweave._ffi": "jax_tokenweave.kernel._ffi",
    "jax_tokenweave.attention": "jax_tokenweave.nn.attention",
    "jax_tokenweave.benchmarking": "jax_tokenweave.bench.benchmarking",
    "jax_tokenweave.comm": "jax_tokenweave.kernel.comm",
    "jax_tokenweave.comm_ipc": "jax_tokenweave.kernel.comm_ipc",
    "jax_tokenweave.cost": "jax_tokenweave.weave.cost",
    "jax_tokenweave.decoder_layer": "jax_tokenweave.nn.decoder_layer",
    "jax_tokenweave.fused": "jax_tokenweave.nn.fused_layout",
    "jax_tokenweave.hlo_check": "jax_tokenweave.bench.hlo_check",
    "jax_tokenweave.kernel_policy": "jax_tokenweave.kernel.policy",
    "jax_tokenweave.layers": "jax_tokenweave.nn.decoder",
    "jax_tokenweave.loopback": "jax_tokenweave.kernel.loopback",
    "jax_tokenweave.modes": "jax_tokenweave.bench.modes",
    "jax_tokenweave.moe": "jax_tokenweave.nn.moe",
    "jax_tokenweave.ops": "jax_tokenweave.kernel.ops",
    "jax_tokenweave.params": "jax_tokenweave.nn.params",
    "jax_tokenweave.reducers": "jax_tokenweave.weave.reducers",
    "jax_tokenweave.schedules": "jax_tokenweave.weave.schedules",
    "jax_tokenweave.split": "jax_tokenweave.weave.plan",
    "jax_tokenweave.stack": "jax_tokenweave.nn.stack",
    "jax_tokenweave.timing": "jax_tokenweave.bench.timing",
    "jax_tokenweave.tuning": "jax_tokenweave.weave.tuning",
    "jax_tokenweave.util": "jax_tokenweave.kernel._util",
}
"""Old module path -> new module path."""


def _warn(message: str, stacklevel: int) -> None:
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


def moved_module(name: str) -> None:
    """Called by a shim module with its ``__name__`` on import: warn, then put the new module in
    ``sys.modules`` under that name (the import statement binds that one)."""
    old = name.replace("jax_tokenweave._legacy.", "jax_tokenweave.")
    new = MOVED[old]
    # stacklevel: this function, the shim's body, then the importer (warnings skips the import
    # machinery's frames).
    _warn(f"{old} is deprecated: it moved to {new}", stacklevel=3)
    sys.modules[name] = importlib.import_module(new)


def renamed_attribute(module: str, name: str, renamed: Mapping[str, str]) -> Any:
    """For a module's ``__getattr__``: ``renamed[name]`` (``"new_name"`` in the same module or
    ``"package.module:new_name"``) with a warning; AttributeError for any other name."""
    target = renamed.get(name)
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    where, _, new = target.rpartition(":")
    where = where or module
    _warn(f"{module}.{name} is deprecated: use {where}.{new}", stacklevel=3)
    return getattr(importlib.import_module(where), new)


def renamed_keyword(call: str, old: str, old_value: Any, new: str, new_value: T) -> T:
    """``new_value``, or ``old_value`` with a warning where the caller of ``call`` passed the
    deprecated keyword ``old`` (not None)."""
    if old_value is None:
        return new_value
    _warn(f"jax_tokenweave: {call}({old}=...) is deprecated: use {new}=", stacklevel=3)
    return old_value


def deprecated(message: str, stacklevel: int = 2) -> None:
    """Warn that something is deprecated (``message`` starts with ``jax_tokenweave``), pointing
    at the caller of the function that calls this (``stacklevel`` 2)."""
    _warn(message, stacklevel=stacklevel + 1)
