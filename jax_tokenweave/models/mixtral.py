"""Mixtral: the Llama architecture with a sparse mixture of experts as the MLP.

``MixtralModel`` is ``LlamaModel`` with ``config.num_experts > 0`` checked; each layer's MoE
(``jax_tokenweave.nn.moe``) holds the router and the experts stacked ``[E, ...]``, each expert's
FFN dimension sharded over TP.
"""

from __future__ import annotations

from typing import Any

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.models.llama import LlamaModel


class MixtralModel(LlamaModel):
    """``LlamaModel`` for Mixtral configs (``config.num_experts`` must be positive)."""

    def __init__(self, config: DecoderConfig, *args: Any, **kwargs: Any) -> None:
        if config.num_experts <= 0:
            raise ValueError("MixtralModel needs config.num_experts > 0")
        super().__init__(config, *args, **kwargs)
