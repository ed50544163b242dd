"""The model registry: which class serves a Hugging Face ``model_type``; ``from_pretrained``.

``MODEL_CLASSES`` maps every ``model_type`` the config mapping supports
(``jax_tokenweave.hf.config.SUPPORTED_MODEL_TYPES``) to a class; :func:`register_model` adds or
replaces one (a subclass of ``LlamaModel`` with the same constructor). Imports run one way:
this module imports the models, the models import ``jax_tokenweave.hf``, and ``hf`` imports no
model.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from jax_tokenweave.hf.config import load_hf_config
from jax_tokenweave.hf.errors import UnsupportedConfigError
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.models.mixtral import MixtralModel
from jax_tokenweave.models.qwen2 import Qwen2Model

MODEL_CLASSES: dict[str, type[LlamaModel]] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": Qwen2Model,
    "mixtral": MixtralModel,
}


def register_model(model_type: str, cls: type[LlamaModel]) -> None:
    """Serve ``model_type`` checkpoints with ``cls`` (a ``LlamaModel`` subclass)."""
    if not (isinstance(cls, type) and issubclass(cls, LlamaModel)):
        raise ValueError(f"a model class must subclass LlamaModel, got {cls!r}")
    MODEL_CLASSES[model_type] = cls


def model_class(model_type: str) -> type[LlamaModel]:
    """The class registered for ``model_type``; ``UnsupportedConfigError`` where there is none."""
    if model_type not in MODEL_CLASSES:
        raise UnsupportedConfigError(
            f"model_type {model_type!r} is not supported; supported: {sorted(MODEL_CLASSES)}"
        )
    return MODEL_CLASSES[model_type]


def from_pretrained(
    path: str, mesh: Mesh, dtype: Any = None, *, axis_name: str = "tp"
) -> LlamaModel:
    """Load a Hugging Face Llama / Mistral / Qwen2 / Mixtral checkpoint directory with the class
    its ``config.json``'s ``model_type`` is registered to (see ``LlamaModel.from_pretrained``).

    ``dtype``: parameter dtype, floating point (default bfloat16). The model has ``hf_info``
    (``HFModelInfo``: config, EOS ids, ...) attached.
    """
    info = load_hf_config(path)
    return model_class(info.model_type).from_pretrained(path, mesh, dtype, axis_name=axis_name)
