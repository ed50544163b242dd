"""Named ``DecoderConfig``s: real model shapes for benchmarks and tiny ones for CPU tests.

``get_config(name, **overrides)`` returns a copy with fields replaced (e.g. ``num_layers=4``).
Names: ``tiny``, ``tiny-moe``, ``tiny-qwen`` (each divides by TP 1, 2, 4, 8), ``llama3-8b``,
``llama3-70b``, ``qwen2.5-72b``, ``mixtral-8x22b``; their shapes: docs/PACKAGE.md#modelsconfigs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_tokenweave.config import DecoderConfig, RopeScaling

_LLAMA3_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

_TINY = DecoderConfig(
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=16,
    num_kv_heads=8,
    head_dim=8,
    vocab_size=256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=_LLAMA3_SCALING,
)

CONFIGS: dict[str, DecoderConfig] = {
    "tiny": _TINY,
    "tiny-moe": dataclasses.replace(
        _TINY,
        intermediate_size=64,
        num_experts=4,
        experts_per_token=2,
        rope_theta=1e6,
        rope_scaling=None,
    ),
    "tiny-qwen": dataclasses.replace(
        _TINY,
        qkv_bias=True,
        rope_theta=1e6,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "llama3-8b": DecoderConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_SCALING,
    ),
    "llama3-70b": DecoderConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_SCALING,
    ),
    "qwen2.5-72b": DecoderConfig(
        hidden_size=8192,
        intermediate_size=29568,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=152064,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        qkv_bias=True,
    ),
    "mixtral-8x22b": DecoderConfig(
        hidden_size=6144,
        intermediate_size=16384,
        num_layers=56,
        num_heads=48,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=32768,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        num_experts=8,
        experts_per_token=2,
    ),
}


def config_names() -> tuple[str, ...]:
    """The names ``get_config`` knows."""
    return tuple(CONFIGS)


def get_config(name: str, **overrides: Any) -> DecoderConfig:
    """The named config, with ``overrides`` replacing fields; unknown names raise ``ValueError``."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; known: {', '.join(CONFIGS)}")
    config = CONFIGS[name]
    if overrides:
        fields = {f.name for f in dataclasses.fields(DecoderConfig)}
        bad = sorted(set(overrides) - fields)
        if bad:
            raise ValueError(f"unknown DecoderConfig fields {bad}; fields: {sorted(fields)}")
        config = dataclasses.replace(config, **overrides)
    return config
