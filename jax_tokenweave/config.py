"""Model shape configuration shared by the decoder stack, the models and the benchmarks."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (``rope_type == "llama3"`` in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shapes and constants of a Llama-style decoder stack.

    ``num_experts == 0`` means a dense SwiGLU MLP; ``num_experts > 0`` a Mixtral-style sparse MoE
    with ``experts_per_token`` experts per token (each expert's FFN dimension sharded over TP).
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int = 32000
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    num_experts: int = 0
    experts_per_token: int = 2
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
        ):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"DecoderConfig.{name} must be positive, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) must be in 1..num_experts "
                f"({self.num_experts})"
            )

    def check_mesh(self, mesh: Mesh, axis_name: str) -> int:
        """The TP degree (``mesh``'s size along ``axis_name``); ``ValueError`` where the mesh
        has no such axis or a sharded dimension does not divide by it."""
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
        tp = int(mesh.shape[axis_name])
        self.check_tensor_parallel(tp)
        return tp

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ``ValueError`` unless every sharded dimension divides by the TP degree ``tp``."""
        if tp <= 0:
            raise ValueError(f"tensor-parallel degree must be positive, got {tp}")
        for name in ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size"):
            value = getattr(self, name)
            if value % tp:
                raise ValueError(
                    f"{name}={value} is not divisible by the tensor-parallel degree {tp}; "
                    f"choose a TP degree that divides it"
                )
