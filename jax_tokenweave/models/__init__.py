"""Models built on ``WeaveDecoder``, their named configs and the Hugging Face model registry.

- ``configs``: named ``DecoderConfig``s (``get_config``, ``config_names``).
- ``llama``: ``LlamaModel`` (Llama, Qwen2 and Mixtral shapes); ``qwen2`` / ``mixtral``: the
  subclasses that check their configs.
- ``auto``: ``MODEL_CLASSES`` (``model_type`` -> class), ``register_model``, ``from_pretrained``.
"""

from jax_tokenweave.models.auto import MODEL_CLASSES, from_pretrained, register_model
from jax_tokenweave.models.configs import CONFIGS, config_names, get_config
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.models.mixtral import MixtralModel
from jax_tokenweave.models.qwen2 import Qwen2Model

__all__ = [
    "CONFIGS",
    "MODEL_CLASSES",
    "LlamaModel",
    "MixtralModel",
    "Qwen2Model",
    "config_names",
    "from_pretrained",
    "get_config",
    "register_model",
]
