"""What ``LLM(...)`` derives from its arguments and the checkpoint, vLLM's way: the checkpoint
directory of a model id, ``dtype="auto"``, ``max_model_len`` and the KV cache's size.

- :func:`checkpoint_dir`: a directory as given; otherwise a Hugging Face model id, resolved
  offline from the local Hugging Face cache (``huggingface_hub.snapshot_download(...,
  local_files_only=True)``); an id that is not cached raises ``CheckpointError`` saying so.
- :func:`param_dtype`: ``"auto"`` is the checkpoint's ``torch_dtype`` (bfloat16 where it names
  none); names (``"bfloat16"``, ``"half"``, ...) and dtypes are taken as they are.
- :func:`model_len`: the checkpoint's ``max_position_embeddings`` is the default and the upper
  bound of ``max_model_len``.
- :func:`cache_blocks`: ``gpu_memory_utilization`` of each device's memory (JAX's
  ``memory_stats()["bytes_limit"]``: XLA preallocates 75% of a GPU by default, set
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` to change it), less what is in use (the weights) and a
  reserve for a step's activations, divided by the bytes of one block. Where devices report no
  memory (CPU), the cache gets blocks for ``max_num_seqs`` requests of ``max_model_len``,
  capped at :data:`CPU_CACHE_BYTES`.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax.numpy as jnp

from jax_tokenweave.hf.errors import CheckpointError
from jax_tokenweave.kernel._util import ceil_div

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


def block_bytes(model_config: Any, block_size: int, tp: int, dtype: Any) -> int:
    """Bytes of one KV cache block on each device (K and V of every layer, its KV heads)."""
    heads = ceil_div(model_config.num_kv_heads, tp)
    return (
        2
        * model_config.num_layers
        * block_size
        * heads
        * model_config.head_dim
        * jnp.dtype(dtype).itemsize
    )


def activation_reserve(model_config: Any, tokens: int, tp: int) -> int:
    """A generous bound on one step's activation bytes on a device: float32 hidden states,
    q/k/v, the MLP's intermediate and the logits of ``tokens`` rows, four times over."""
    per_row = (
        4 * model_config.hidden_size
        + 3 * model_config.intermediate_size // tp
        + model_config.vocab_size // tp
    )
    return 4 * 4 * tokens * per_row


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
    devices: Any, model_config: Any, engine: Any, dtype: Any, utilization: float
) -> int:
    """Blocks for a cache of ``utilization`` of the devices' memory (module docstring)."""
    check_utilization(utilization)
    tp = len(devices)
    per_block = block_bytes(model_config, engine.block_size, tp, dtype)
    request_blocks = ceil_div(engine.max_model_len, engine.block_size)
    stats = [d.memory_stats() for d in devices]
    if any(not s or "bytes_limit" not in s for s in stats):
        fit = max(CPU_CACHE_BYTES // per_block, request_blocks)
        return int(min(engine.max_num_seqs * request_blocks, fit))
    reserve = activation_reserve(model_config, engine.max_num_batched_tokens, tp)
    free = min(
        math.floor(s["bytes_limit"] * utilization) - s.get("bytes_in_use", 0) - reserve
        for s in stats
    )
    blocks = free // per_block
    if blocks < request_blocks:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves room for {max(blocks, 0)} KV cache "
            f"blocks, fewer than one request of max_model_len={engine.max_model_len} needs "
            f"({request_blocks}); raise gpu_memory_utilization or lower max_model_len"
        )
    return int(blocks)
