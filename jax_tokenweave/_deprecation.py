"""Helpers for deprecating a name in place: the old name keeps working for one release and warns
with a ``DeprecationWarning`` that names the new one (every message starts with
``jax_tokenweave``; the tests turn such warnings into errors). Imports nothing from the
package, so every part of it may use this. How to deprecate a name: CONTRIBUTING.md.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def deprecated(message: str, stacklevel: int = 2) -> None:
    """Warn that something is deprecated (``message`` starts with ``jax_tokenweave``), pointing
    at the caller of the function that calls this (``stacklevel`` 2)."""
    if not message.startswith("jax_tokenweave"):
        raise ValueError(f"message must start with 'jax_tokenweave', got {message!r}")
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


def renamed_attribute(module: str, name: str, renamed: Mapping[str, str]) -> Any:
    """For a module's ``__getattr__``: ``renamed[name]`` (``"new_name"`` in the same module or
    ``"package.module:new_name"``) with a warning; AttributeError for any other name."""
    target = renamed.get(name)
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    where, _, new = target.rpartition(":")
    where = where or module
    deprecated(f"{module}.{name} is deprecated: use {where}.{new}", stacklevel=3)
    return getattr(importlib.import_module(where), new)


def renamed_keyword(call: str, old: str, old_value: Any, new: str, new_value: T) -> T:
    """``new_value``, or ``old_value`` with a warning where the caller of ``call`` passed the
    deprecated keyword ``old`` (not None)."""
    if old_value is None:
        return new_value
    deprecated(f"jax_tokenweave: {call}({old}=...) is deprecated: use {new}=", stacklevel=3)
    return old_value


def moved_module(name: str, new: str) -> None:
    """For a module left at an old path (a file that only calls this with its ``__name__``): warn
    at its importer, then put the module ``new`` in ``sys.modules`` under ``name``, so that the
    import statement binds the new module itself."""
    # stacklevel 3 past deprecated(): this function, the old module's body, then its importer
    # (warnings skips the import machinery's frames).
    deprecated(f"{name} is deprecated: it moved to {new}", stacklevel=3)
    sys.modules[name] = importlib.import_module(new)
