"""TokenWeave for JAX: overlap tensor-parallel communication with compute in LLM inference.

Public names (loaded lazily: ``import jax_tokenweave`` imports neither JAX nor Flax):
``allreduce_rmsnorm``, ``plan_batch``, ``BatchPlan``, ``WeaveDecoder``, ``DecoderConfig``,
``RopeScaling``, ``get_config``, ``from_pretrained``, ``LLM``, ``SamplingParams``.
Importing any module of the package changes no global state (environment, JAX config).
Where each name lives and the parts' import order: docs/PACKAGE.md#jax_tokenweave.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.4.0"

_EXPORTS: dict[str, str] = {
    "allreduce_rmsnorm": "jax_tokenweave.kernel.ops",
    "plan_batch": "jax_tokenweave.weave.plan",
    "BatchPlan": "jax_tokenweave.weave.plan",
    "WeaveDecoder": "jax_tokenweave.nn.decoder",
    "DecoderConfig": "jax_tokenweave.config",
    "RopeScaling": "jax_tokenweave.config",
    "get_config": "jax_tokenweave.models.configs",
    "from_pretrained": "jax_tokenweave.models.auto",
    "LLM": "jax_tokenweave.serving.offline.llm",
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
