"""Models built on ``WeaveDecoder``, their named configs and the Hugging Face model registry.

- ``configs``: named ``DecoderConfig``s (``get_config``, ``config_names``); imports no JAX.
- ``llama``: ``LlamaModel`` (Llama, Qwen2 and Mixtral shapes); ``qwen2`` / ``mixtral``: the
  subclasses that check their configs.
- ``auto``: ``MODEL_CLASSES`` (``model_type`` -> class), ``register_model``, ``from_pretrained``.

The model names below load lazily, so ``import jax_tokenweave.models.configs`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from jax_tokenweave.models.configs import CONFIGS, config_names, get_config

_EXPORTS: dict[str, str] = {
    "LlamaModel": "jax_tokenweave.models.llama",
    "Qwen2Model": "jax_tokenweave.models.qwen2",
    "MixtralModel": "jax_tokenweave.models.mixtral",
    "MODEL_CLASSES": "jax_tokenweave.models.auto",
    "register_model": "jax_tokenweave.models.auto",
    "from_pretrained": "jax_tokenweave.models.auto",
}

__all__ = ["CONFIGS", "config_names", "get_config", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jax_tokenweave.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
