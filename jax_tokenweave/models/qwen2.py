"""Qwen2: the Llama architecture with a bias on the q/k/v projections (``qkv_bias=True``).

``Qwen2Model`` is ``LlamaModel`` with that checked; the biases are
``decoder.layers.{i}.qkv_bias``, fused per rank (``params.logical_weights`` gives the logical
``q_bias``, ``k_bias``, ``v_bias``; see ``jax_tokenweave.nn.decoder_layer``). Qwen2's sliding
window is not implemented (full causal attention; the loader warns where a checkpoint enables
it).
"""

from __future__ import annotations

from typing import Any

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.models.llama import LlamaModel


class Qwen2Model(LlamaModel):
    """``LlamaModel`` for Qwen2 configs (``config.qkv_bias`` must be True, no experts)."""

    def __init__(self, config: DecoderConfig, *args: Any, **kwargs: Any) -> None:
        if not config.qkv_bias or config.num_experts:
            raise ValueError("Qwen2Model needs config.qkv_bias=True and num_experts=0")
        super().__init__(config, *args, **kwargs)
