"""Memory-roofline helpers shared by ``attention_bench.py``, ``decode_bench.py`` and
``prefill_bench.py``: the device's bandwidth measured by a device-to-device copy, and the bytes a
decode step must move.

The benchmarks load this file by path (:func:`load`), so that it is found under ``python -P``
(which keeps the script's folder off ``sys.path``) as well.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

GB = 1e9


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (loaded once per process)."""
    key = f"_benchmarks_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).parent / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def copy_bandwidth(device: Any, nbytes: int, *, warmup: int = 3,
                   iters: int = 10) -> dict[str, float]:
    """The bandwidth of ``device``'s memory from a device-to-device copy of ``nbytes`` bytes
    (one jitted ``jnp.copy`` per call, timed like every benchmark here:
    ``jax_tokenweave.timing.benchmark``, median of ``iters`` calls after ``warmup``).

    Returns ``{"bytes", "median_ms", "gb_s"}``; ``gb_s`` counts the bytes read and the bytes
    written (``2 * bytes / time``, in 1e9 B/s).
    """
    import jax
    import jax.numpy as jnp

    from jax_tokenweave import timing

    n = max(int(nbytes) // 4, 1)
    x = jax.jit(lambda: jnp.arange(n, dtype=jnp.float32),
                out_shardings=jax.sharding.SingleDeviceSharding(device))()
    copy = jax.jit(jnp.copy)
    stats = timing.benchmark({"copy": lambda: copy(x)}, warmup=warmup, iters=iters)["copy"]
    return {"bytes": 4 * n, "median_ms": stats.median_ms,
            "gb_s": 2 * 4 * n / (stats.median_ms * 1e-3) / GB}


def kv_bytes(keys: int, kv_heads: int, head_dim: int, itemsize: int, layers: int = 1) -> int:
    """Bytes of K and V read for ``keys`` cached positions (summed over requests), every layer:
    ``keys * kv_heads * head_dim * itemsize * 2 (K and V) * layers``."""
    return keys * kv_heads * head_dim * itemsize * 2 * layers


def decode_step_bytes(weight_bytes: int, batch: int, context: int, kv_heads: int,
                      head_dim: int, itemsize: int, layers: int) -> int:
    """Bytes a decode step of ``batch`` requests of ``context`` cached positions must move at
    least: every weight once (:func:`weight_bytes`) and every request's K/V of every layer."""
    return weight_bytes + kv_bytes(batch * context, kv_heads, head_dim, itemsize, layers)


def weight_bytes(model: Any, device: Any) -> int:
    """Bytes of ``model``'s parameters that ``device`` holds and a decode step reads: all of
    them but the embedding table (a decode step gathers a few rows of it), which is counted once
    as the LM head where the head is tied to it (``tie_word_embeddings``)."""
    from flax import nnx

    def on_device(x: Any) -> int:
        return sum(s.data.nbytes for s in x.addressable_shards if s.device == device)

    total = sum(on_device(leaf) for leaf in jax_leaves(nnx.state(model, nnx.Param)))
    if not model.config.tie_word_embeddings:
        total -= on_device(model.embed.get_value())
    return total


def jax_leaves(tree: Any) -> list[Any]:
    """The array leaves of a pytree (``nnx.State`` included)."""
    import jax

    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "addressable_shards")]
