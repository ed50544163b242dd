"""JAX's persistent compilation cache for the engine's programs (``EngineConfig.
compilation_cache_dir``): a second engine of the same model and sizes, in this process after
``jax.clear_caches()`` or in a later one, loads its compiled steps from disk instead of
compiling them.

The directory is set with ``jax.config.update("jax_compilation_cache_dir", ...)`` unless the
user set one (theirs is kept), and every program is cached
(``jax_persistent_cache_min_compile_time_secs=0``) unless the user set that threshold.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache as _cc

DEFAULT_DIR = "~/.cache/jax_tokenweave/xla"
_MIN_TIME = "jax_persistent_cache_min_compile_time_secs"
_MIN_TIME_DEFAULT = 1.0
_ours: str | None = None  # the directory this module set (None: none)


def use_compilation_cache(path: str | os.PathLike | None) -> str | None:
    """Cache compiled programs in ``path`` (``~`` expanded, made where missing) unless the user
    set a cache directory (module docstring); None leaves JAX as it is. Returns the directory
    JAX caches in (None: none)."""
    global _ours
    # jax.config's options are attributes it sets at run time: its stubs do not declare them
    current: str | None = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    if path is None or (current and current != _ours):
        return current or None
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if path != current:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        if current:
            _cc.reset_cache()  # JAX opens its cache once: let it open the new directory
        _ours = path
    if getattr(jax.config, _MIN_TIME) == _MIN_TIME_DEFAULT and _MIN_TIME.upper() not in os.environ:
        jax.config.update(_MIN_TIME, 0.0)
    return path
