"""The executable cache's key (``serving.compilation.executable_cache``): a hash of everything that
can change a compiled step program.

:func:`program_key` hashes the caller's description of the program (the layout, every static
argument, the model's type, config and graph definition, the compiler options, and
:func:`describe_args` of the inputs: their tree, shapes, dtypes and shardings with their mesh and
device ids) plus :func:`environment`: JAX, jaxlib, flax, NumPy and Python versions, the
backend's platform, version and device kinds, JAX's config values, the ``XLA_*`` /
``JAX_TOKENWEAVE_*`` environment variables, and :func:`source_hash` (this package's
``.py``/``.json`` sources and the built CUDA extension).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

_ENV_PREFIXES = ("XLA_", "JAX_TOKENWEAVE_", "LIBTPU_INIT_ARGS", "NCCL_", "NVIDIA_TF32")
_ENV_SKIP = ("JAX_TOKENWEAVE_COMMIT",)
_CONFIG_SKIP = (
    "cache",
    "log",
    "dump",
    "traceback",
    "pprint",
    "timeout",
    "explain",
    "transfer_guard",
    "source_url",
    "debug_key_reuse",
)


def leaf_dtype(leaf: Any) -> np.dtype:
    """A leaf's dtype (a ``jax.Array``'s, a NumPy array's or a Python scalar's)."""
    dtype = getattr(leaf, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.result_type(leaf)


def leaf_shape(leaf: Any) -> tuple[int, ...]:
    """A leaf's shape (``()`` for a Python scalar)."""
    shape = getattr(leaf, "shape", None)
    return tuple(shape) if shape is not None else tuple(np.shape(leaf))


def describe_leaf(leaf: Any) -> tuple[Any, ...]:
    """A leaf's part of the key: shape, dtype, weak type and placement (a ``jax.Array``'s or
    ``jax.ShapeDtypeStruct``'s sharding with its mesh axes, shape and device ids in order;
    ``host`` for NumPy)."""
    shape, dtype = leaf_shape(leaf), str(leaf_dtype(leaf))
    if getattr(leaf, "sharding", None) is None:
        return shape, dtype, "host"
    sharding = leaf.sharding
    mesh = getattr(sharding, "mesh", None)
    where: tuple[Any, ...]
    if mesh is not None and hasattr(mesh, "devices"):
        where = (
            type(sharding).__name__,
            repr(getattr(sharding, "spec", None)),
            tuple(mesh.axis_names),
            tuple(mesh.devices.shape),
            tuple(int(d.id) for d in mesh.devices.flat),
            getattr(sharding, "memory_kind", None),
        )
    else:
        where = (
            type(sharding).__name__,
            repr(sharding),
            tuple(sorted(int(d.id) for d in sharding.device_set)),
        )
    return shape, dtype, bool(getattr(leaf, "weak_type", False)), where


def describe_args(args: Any) -> dict[str, Any]:
    """The key's part for a pytree of arguments: its structure and every leaf (by path)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(args)
    return {
        "tree": str(treedef),
        "leaves": [(jax.tree_util.keystr(path), describe_leaf(leaf)) for path, leaf in leaves],
    }


@functools.cache
def source_hash() -> str:
    """SHA-256 of this package's ``.py`` and ``.json`` files (paths and bytes) and of the built
    CUDA extension's file where it imported."""
    from jax_tokenweave.kernel import _extension

    root = Path(__file__).resolve().parents[2]  # jax_tokenweave/
    digest = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json") and p.is_file())
    built = _extension.get().__file__ if _extension.import_error() is None else None
    if built is not None:
        files.append(Path(built))
    for path in files:
        digest.update(
            str(path.relative_to(root) if path.is_relative_to(root) else path.name).encode()
        )
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def environment(devices: Iterable[Any]) -> dict[str, Any]:
    """The key's part that is not the program's own description (module docstring), for a
    program on ``devices``."""
    import flax
    import jaxlib

    devices = list(devices)
    client = devices[0].client if devices else None
    return {
        "python": sys.version_info[:2],
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "numpy": np.__version__,
        "platform": sorted({d.platform for d in devices}),
        "device_kinds": sorted({d.device_kind for d in devices}),
        "platform_version": getattr(client, "platform_version", None),
        "config": {
            k: repr(v)
            for k, v in sorted(jax.config.values.items())
            if not any(s in k for s in _CONFIG_SKIP)
        },
        "env": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith(_ENV_PREFIXES) and k not in _ENV_SKIP
        },
        "source": source_hash(),
    }


def program_key(program: Mapping[str, Any], devices: Iterable[Any]) -> str:
    """A program's cache key (hex SHA-256): ``program`` (the caller's description: layout,
    static arguments, model, :func:`describe_args` of the inputs, compiler options; values
    are keyed by ``repr`` where not JSON) plus :func:`environment`."""
    text = json.dumps(
        {"program": program, "environment": environment(devices)}, sort_keys=True, default=repr
    )
    return hashlib.sha256(text.encode()).hexdigest()
