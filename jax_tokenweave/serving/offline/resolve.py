"""What ``LLM(...)`` derives from its arguments and the checkpoint, vLLM's way.

:func:`checkpoint_dir` (a directory, or a model id from the local cache: ``CheckpointError`` if
not cached), :func:`param_dtype` (``"auto"``: the checkpoint's ``torch_dtype``),
:func:`model_len` (``max_position_embeddings`` bounds ``max_model_len``), :func:`cache_blocks`
(the KV cache's size from free memory). The rules: docs/SERVING.md#servingofflineresolve.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from jax_tokenweave.hf.errors import CheckpointError
from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.serving.runner import memory

CPU_CACHE_BYTES = 1 << 30
TORCH_DTYPES = {
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "half": jnp.float16,
    "float32": jnp.float32,
    "float": jnp.float32,
}


def checkpoint_dir(model: str | os.PathLike) -> str:
    """A checkpoint directory for ``model``: the directory itself, or the snapshot of a
    Hugging Face model id in the local cache (module docstring)."""
    path = os.fspath(model)
    if os.path.isdir(path):
        return path
    if path.startswith((".", "/", "~")) or path.count("/") > 1:  # a path, not an org/name id
        raise CheckpointError(f"checkpoint directory does not exist: {path}")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, local_files_only=True)
    except Exception as err:  # LocalEntryNotFoundError, HFValidationError, ...
        from huggingface_hub.constants import HF_HUB_CACHE

        raise CheckpointError(
            f"{path!r} is not a checkpoint directory, and not a model in the local Hugging Face "
            f"cache ({HF_HUB_CACHE}); models are not downloaded here: fetch it first "
            f"(hf download {path}) or pass a directory ({type(err).__name__})"
        ) from None


def param_dtype(dtype: Any, torch_dtype: str | None) -> Any:
    """The parameter dtype for ``dtype`` (``"auto"``: from the checkpoint's ``torch_dtype``)."""
    if isinstance(dtype, str):
        name = (torch_dtype or "bfloat16") if dtype == "auto" else dtype
        name = name.removeprefix("torch.")
        if name not in TORCH_DTYPES:
            what = f"the checkpoint's torch_dtype {name!r}" if dtype == "auto" else repr(dtype)
            raise ValueError(
                f"LLM dtype: {what} is not one of 'auto', {', '.join(map(repr, TORCH_DTYPES))}"
            )
        return TORCH_DTYPES[name]
    return dtype


def model_len(max_model_len: int | None, limit: int | None, default: int) -> int:
    """``max_model_len`` checked against the checkpoint's ``limit``; None: ``limit`` (or
    ``default`` where the checkpoint has none)."""
    from jax_tokenweave.serving import checks

    if max_model_len is None:
        return limit if limit is not None else default
    max_model_len = checks.at_least(max_model_len, 2, "LLM max_model_len")
    if limit is not None and max_model_len > limit:
        raise ValueError(
            f"LLM max_model_len={max_model_len} exceeds the model's "
            f"max_position_embeddings ({limit})"
        )
    return max_model_len


def check_utilization(utilization: Any) -> float:
    """``gpu_memory_utilization`` in (0, 1] (``ValueError`` naming it else)."""
    if not (
        isinstance(utilization, int | float)
        and not isinstance(utilization, bool)
        and 0 < utilization <= 1
    ):
        raise ValueError(f"LLM gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    return float(utilization)


def cache_blocks(
    devices: Any,
    model_config: Any,
    engine: Any,
    dtype: Any,
    utilization: float,
    stats: Sequence[dict[str, int] | None] | None = None,
    extra: int = 0,
) -> int:
    """Blocks for a cache of ``utilization`` of the devices' memory (module docstring);
    ``stats``: the devices' ``memory_stats()`` (default: read now); ``extra``: more bytes
    the engine holds beside the cache (its sampling state)."""
    check_utilization(utilization)
    tp = len(devices)
    per_block = memory.block_bytes(model_config, engine.block_size, tp, dtype)
    request_blocks = ceil_div(engine.max_model_len, engine.block_size)
    read = [d.memory_stats() for d in devices] if stats is None else list(stats)
    known = [s for s in read if s and "bytes_limit" in s]
    if len(known) < len(read):
        fit = max(CPU_CACHE_BYTES // per_block, request_blocks)
        return int(min(engine.max_num_seqs * request_blocks, fit))
    reserve = memory.activation_reserve(model_config, engine.max_num_batched_tokens, tp) + extra
    free = min(
        math.floor(s["bytes_limit"] * utilization) - s.get("bytes_in_use", 0) - reserve
        for s in known
    )
    blocks = free // per_block
    if blocks < request_blocks:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves room for {max(blocks, 0)} KV cache "
            f"blocks, fewer than one request of max_model_len={engine.max_model_len} needs "
            f"({request_blocks}); raise gpu_memory_utilization or lower max_model_len"
        )
    return int(blocks)
