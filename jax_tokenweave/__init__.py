"""TokenWeave for JAX: overlap tensor-parallel communication with compute in LLM inference.

The public names below load lazily, so ``import jax_tokenweave`` imports neither JAX nor Flax;
importing any module of the package changes no global state (environment, JAX config).

- ``allreduce_rmsnorm`` (``jax_tokenweave.kernel.ops``): fused all-reduce + residual add + RMSNorm.
- ``plan_batch``, ``BatchPlan`` (``jax_tokenweave.weave.plan``): wave-aware token split planning.
- ``WeaveDecoder`` (``jax_tokenweave.nn.decoder``): the tensor-parallel decoder stack and schedules.
- ``DecoderConfig``, ``RopeScaling`` (``jax_tokenweave.config``), ``get_config``
  (``jax_tokenweave.models.configs``): model shapes.
- ``from_pretrained`` (``jax_tokenweave.models.auto``): a Hugging Face checkpoint directory ->
  the model class its ``model_type`` is registered to, each device reading only its shards.
- ``LLM``, ``SamplingParams`` (``jax_tokenweave.serving``): serve a checkpoint, text in and out
  (continuous batching, paged KV cache, streaming); ``python -m jax_tokenweave.generate``.

The parts, bottom up (each imports only those before it): ``config``, ``kernel`` (the fused
kernel), ``weave`` (plan, tuning, reducers, schedules), ``nn`` (the decoder), ``hf``, ``models``,
``serving``; then the commands ``launch``, ``generate``, ``serve`` and ``bench`` (the main job).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.2.0"

# Old module paths (``jax_tokenweave.ops``, ``.layers``, ...) find their shims in ``_legacy/``
# for one release: each warns and resolves to the new module. No import hook is registered.
__path__.append(os.path.join(os.path.dirname(__file__), "_legacy"))

_EXPORTS: dict[str, str] = {
    "allreduce_rmsnorm": "jax_tokenweave.kernel.ops",
    "plan_batch": "jax_tokenweave.weave.plan",
    "BatchPlan": "jax_tokenweave.weave.plan",
    "WeaveDecoder": "jax_tokenweave.nn.decoder",
    "DecoderConfig": "jax_tokenweave.config",
    "RopeScaling": "jax_tokenweave.config",
    "get_config": "jax_tokenweave.models.configs",
    "from_pretrained": "jax_tokenweave.models.auto",
    "LLM": "jax_tokenweave.serving.llm",
    "SamplingParams": "jax_tokenweave.serving.sampling_params",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jax_tokenweave' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
