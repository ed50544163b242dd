"""A Hugging Face ``config.json`` (+ ``generation_config.json``) -> ``DecoderConfig`` and more.

Supported ``model_type``: ``llama``, ``mistral`` (Llama layout), ``qwen2`` (qkv bias) and
``mixtral`` (sparse MoE). A file that is not a JSON object, or a field of the wrong type, raises
:class:`CheckpointError` naming the file; a model or feature not implemented here raises
:class:`UnsupportedConfigError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from jax_tokenweave.config import DecoderConfig, RopeScaling
from jax_tokenweave.hf.errors import CheckpointError, UnsupportedConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class HFModelInfo:
    """What ``config.json`` (and ``generation_config.json``, if present) say about a model."""

    model_type: str
    config: DecoderConfig
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    torch_dtype: str | None
    max_position_embeddings: int | None = None


def read_json(path: str) -> dict[str, Any]:
    """Parse a JSON file holding one object; :class:`CheckpointError` naming ``path`` if it is
    missing, not valid JSON, or not an object."""
    if not os.path.isfile(path):
        raise CheckpointError(f"missing file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def load_hf_config(path: str) -> HFModelInfo:
    """Read ``path/config.json`` (+ ``generation_config.json``) into an :class:`HFModelInfo`."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory does not exist: {path}")
    config_path = os.path.join(path, CONFIG_FILE)
    raw = read_json(config_path)
    gen_path = os.path.join(path, GENERATION_CONFIG_FILE)
    gen = read_json(gen_path) if os.path.isfile(gen_path) else {}

    def pick(key: str) -> tuple[Any, str]:
        return (gen[key], gen_path) if gen.get(key) is not None else (raw.get(key), config_path)

    try:
        config = decoder_config_from_hf(raw)
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"{config_path}: {e}") from e
    torch_dtype = raw.get("dtype", raw.get("torch_dtype"))
    return HFModelInfo(
        model_type=raw["model_type"],
        config=config,
        eos_token_ids=_token_ids(*pick("eos_token_id"), "eos_token_id"),
        bos_token_id=_optional_id(*pick("bos_token_id"), "bos_token_id"),
        pad_token_id=_optional_id(*pick("pad_token_id"), "pad_token_id"),
        torch_dtype=torch_dtype if isinstance(torch_dtype, str) else None,
        max_position_embeddings=_optional_id(
            raw.get("max_position_embeddings"), config_path, "max_position_embeddings"
        ),
    )


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: Any, source: str, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(_is_id(t) for t in items):
        raise CheckpointError(f"{source}: {key} must be an int or a list of ints, got {value!r}")
    return tuple(items)


def _optional_id(value: Any, source: str, key: str) -> int | None:
    if value is not None and not _is_id(value):
        raise CheckpointError(f"{source}: {key} must be an int, got {value!r}")
    return value


def _number(raw: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
    """``raw[key]`` as ``kind`` (int or float); ``default`` where absent (None: required)."""
    value = raw.get(key)
    if value is None:
        if default is None:
            raise UnsupportedConfigError(f"config lacks required key {key!r}")
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (kind is int and value != int(value))
    ):
        raise UnsupportedConfigError(f"{key} must be {kind.__name__}, got {value!r}")
    return kind(value)


def decoder_config_from_hf(raw: Mapping[str, Any]) -> DecoderConfig:
    """Map a Hugging Face ``config.json`` dict to a :class:`DecoderConfig`.

    Raises :class:`UnsupportedConfigError` for a model type or feature not implemented here
    (other activations, attention output / MLP biases, RoPE scaling other than ``llama3``) and
    for missing or mistyped fields; warns that a sliding window, where one is set, is ignored
    (full causal attention is used).
    """
    if not isinstance(raw, Mapping):
        raise UnsupportedConfigError(f"a config must be a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError(
            f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
        )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
    if raw.get("mlp_bias"):
        raise UnsupportedConfigError("mlp_bias=True is not supported")
    if model_type in ("llama", "mistral") and raw.get("attention_bias"):
        raise UnsupportedConfigError(
            "attention_bias=True (a bias on q/k/v *and* o_proj) is not supported"
        )
    _warn_sliding_window(raw, model_type)

    hidden = _number(raw, "hidden_size", int)
    heads = _number(raw, "num_attention_heads", int)
    theta, scaling = _rope(raw)
    num_experts = _number(raw, "num_local_experts", int) if model_type == "mixtral" else 0
    extra = {"experts_per_token": _number(raw, "num_experts_per_tok", int)} if num_experts else {}
    try:
        return DecoderConfig(
            hidden_size=hidden,
            intermediate_size=_number(raw, "intermediate_size", int),
            num_layers=_number(raw, "num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=_number(raw, "num_key_value_heads", int, heads),
            head_dim=_number(raw, "head_dim", int, hidden // max(heads, 1)),
            vocab_size=_number(raw, "vocab_size", int),
            rms_norm_eps=_number(raw, "rms_norm_eps", float, 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=model_type == "qwen2",
            num_experts=num_experts,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            **extra,
        )
    except ValueError as e:
        raise UnsupportedConfigError(f"config.json describes an invalid model: {e}") from e


def _rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, RopeScaling | None)`` from ``rope_parameters`` (transformers >= 5) or the
    older top-level ``rope_theta`` + ``rope_scaling``."""
    params, scaling = raw.get("rope_parameters") or {}, raw.get("rope_scaling") or {}
    if not isinstance(params, Mapping) or not isinstance(scaling, Mapping):
        raise UnsupportedConfigError("rope_parameters / rope_scaling must be JSON objects")
    merged = {**scaling, **params}
    theta = _number(
        {"rope_theta": params.get("rope_theta", raw.get("rope_theta"))},
        "rope_theta",
        float,
        10000.0,
    )
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedConfigError(
            f"rope scaling type {rope_type!r} is not supported (only 'default' and 'llama3')"
        )
    for key in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ):
        if key not in merged:
            raise UnsupportedConfigError(f"llama3 rope scaling lacks key {key!r}")
    return theta, RopeScaling(
        factor=_number(merged, "factor", float),
        low_freq_factor=_number(merged, "low_freq_factor", float),
        high_freq_factor=_number(merged, "high_freq_factor", float),
        original_max_position_embeddings=_number(merged, "original_max_position_embeddings", int),
    )


def _warn_sliding_window(raw: Mapping[str, Any], model_type: str) -> None:
    window = raw.get("sliding_window")
    if model_type == "qwen2":
        active = bool(raw.get("use_sliding_window")) and window is not None
    else:
        active = window is not None
    if active:
        warnings.warn(
            f"{model_type}: sliding_window={window} is ignored; full causal attention is used "
            f"(identical for sequences no longer than the window)",
            stacklevel=3,
        )
