"""Hugging Face tensor names -> this library's parameters, and loading a model class from them.

:func:`load_pretrained` builds the model abstractly (``nnx.eval_shape``, no random weights), then
fills each parameter with :func:`~jax_tokenweave.hf.reader.load_sharded` under the sharding its
Flax metadata names, so every device reads only its own shard of each tensor. Which class serves
which ``model_type`` is the model registry's business (``jax_tokenweave.models.auto``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.hf.config import load_hf_config
from jax_tokenweave.hf.errors import CheckpointError
from jax_tokenweave.hf.reader import Fused, SafetensorsCheckpoint, Source, few, load_sharded
from jax_tokenweave.nn.fused_layout import fuse_names
from jax_tokenweave.nn.params import named_params, param_spec


def hf_sources(config: DecoderConfig) -> dict[str, Source]:
    """``{logical parameter name of LlamaModel: Source}`` for a Hugging Face Llama/Qwen2/Mixtral
    layout (``q_proj``, ``k_proj``, ... unfused: :func:`fused_sources` fuses them).

    The stored shapes follow from ``config`` (HF ``[out, in]`` linears, transposed on load);
    MoE experts ``experts.{e}.w1/w3/w2`` are stacked into ``[E, ...]`` arrays.
    """
    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    nq, nkv, v, e = (
        config.num_heads * d,
        config.num_kv_heads * d,
        config.vocab_size,
        config.num_experts,
    )
    out = {
        "embed": Source("model.embed_tokens.weight", (v, h)),
        "decoder.final_norm": Source("model.norm.weight", (h,)),
    }
    if not config.tie_word_embeddings:
        out["lm_head"] = Source("lm_head.weight", (v, h), transpose=True)
    for i in range(config.num_layers):
        hf_p, p = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf_p + "self_attn."
        out.update(
            {
                p + "input_layernorm": Source(hf_p + "input_layernorm.weight", (h,)),
                p + "post_attention_layernorm": Source(
                    hf_p + "post_attention_layernorm.weight", (h,)
                ),
                p + "q_proj": Source(attn + "q_proj.weight", (nq, h), transpose=True),
                p + "k_proj": Source(attn + "k_proj.weight", (nkv, h), transpose=True),
                p + "v_proj": Source(attn + "v_proj.weight", (nkv, h), transpose=True),
                p + "o_proj": Source(attn + "o_proj.weight", (h, nq), transpose=True),
            }
        )
        if config.qkv_bias:
            out.update(
                {
                    p + "q_bias": Source(attn + "q_proj.bias", (nq,)),
                    p + "k_bias": Source(attn + "k_proj.bias", (nkv,)),
                    p + "v_bias": Source(attn + "v_proj.bias", (nkv,)),
                }
            )
        if e:
            moe = hf_p + "block_sparse_moe."

            def experts(w: str, shape: tuple[int, int], moe: str = moe) -> Source:
                names = tuple(f"{moe}experts.{j}.{w}.weight" for j in range(e))
                return Source(names, shape, transpose=True)

            out.update(
                {
                    p + "moe.router": Source(moe + "gate.weight", (e, h), transpose=True),
                    p + "moe.gate_proj": experts("w1", (f, h)),
                    p + "moe.up_proj": experts("w3", (f, h)),
                    p + "moe.down_proj": experts("w2", (h, f)),
                }
            )
        else:
            mlp = hf_p + "mlp."
            out.update(
                {
                    p + "gate_proj": Source(mlp + "gate_proj.weight", (f, h), transpose=True),
                    p + "up_proj": Source(mlp + "up_proj.weight", (f, h), transpose=True),
                    p + "down_proj": Source(mlp + "down_proj.weight", (h, f), transpose=True),
                }
            )
    return out


def fused_sources(sources: Mapping[str, Source], tp: int) -> dict[str, Source | Fused]:
    """``sources`` (logical names) with each fused parameter's parts combined into one
    :class:`~jax_tokenweave.hf.reader.Fused` source laid out for TP degree ``tp`` (the model's
    parameter names: ``qkv_proj``, ``qkv_bias``, ``gate_up_proj``)."""
    return fuse_names(sources, lambda _, parts: Fused(tuple(parts), tp))


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_checkpoint(
    ckpt: SafetensorsCheckpoint, sources: Mapping[str, Source], config: DecoderConfig
) -> None:
    """Check every source exists with its shape (one error listing all problems); warn about
    checkpoint tensors the model does not use (a tied ``lm_head.weight`` is silently unused)."""
    missing, wrong = [], []
    used: set[str] = set()
    for src in sources.values():
        for name in src.all_names:
            used.add(name)
            if name not in ckpt:
                missing.append(name)
            elif ckpt.info(name).shape != src.shape:
                wrong.append(f"{name}: {ckpt.info(name).shape}, expected {src.shape}")
    problems = []
    if missing:
        problems.append(f"missing tensors: {few(missing)}")
    if wrong:
        problems.append(
            f"tensors of the wrong shape (the config implies the expected one): {few(wrong)}"
        )
    if problems:
        raise CheckpointError(f"{ckpt.path}: " + "; ".join(problems))
    unused = [
        n
        for n in ckpt.tensors
        if n not in used
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (config.tie_word_embeddings and n == "lm_head.weight")
    ]
    if unused:
        warnings.warn(
            f"{ckpt.path}: {len(unused)} checkpoint tensors are not used by the "
            f"model: {few(unused)}",
            stacklevel=3,
        )


def float_dtype(dtype: Any) -> jnp.dtype:
    """``dtype`` as a floating-point ``jnp.dtype`` (None: bfloat16); ``ValueError`` otherwise."""
    if dtype is None:
        return jnp.dtype(jnp.bfloat16)
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype!r}") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            f"dtype must be a floating-point dtype (bfloat16, float16, float32), got {dt}"
        )
    return dt


def load_pretrained(
    model_cls: type, path: str, mesh: Mesh, dtype: Any = None, *, axis_name: str = "tp"
) -> Any:
    """``model_cls(config, mesh, axis_name=, dtype=, rngs=)`` with its weights read from a Hugging
    Face checkpoint directory ``path`` (``config.json`` + safetensors files).

    Returns the model with ``model.hf_info`` (``HFModelInfo``: config, EOS ids, ...) attached.
    Raises ``CheckpointError`` (missing, truncated or corrupt files, missing tensors, wrong
    shapes), ``UnsupportedConfigError`` (a model type or feature not implemented) and
    ``ValueError`` (a dtype that is not floating point; a config that does not divide by the
    mesh's TP degree).
    """
    dtype = float_dtype(dtype)
    info = load_hf_config(path)
    ckpt = SafetensorsCheckpoint(path)
    check_checkpoint(ckpt, hf_sources(info.config), info.config)
    model = nnx.eval_shape(
        lambda: model_cls(info.config, mesh, axis_name=axis_name, dtype=dtype, rngs=nnx.Rngs(0))
    )
    sources = fused_sources(hf_sources(info.config), mesh.shape[axis_name])
    params = named_params(model)
    if set(params) != set(sources):
        raise CheckpointError(
            f"internal: parameter names {sorted(set(params) ^ set(sources))} do not match "
            f"between {model_cls.__name__} and the Hugging Face mapping"
        )
    for name, param in params.items():
        abstract = param.get_value()
        src = sources[name]
        if tuple(abstract.shape) != src.target_shape():
            raise CheckpointError(
                f"internal: {name} has shape {abstract.shape}, the checkpoint "
                f"mapping gives {src.target_shape()}"
            )
        param.set_value(load_sharded(ckpt, src, mesh, param_spec(param), abstract.dtype))
    model.hf_info = info
    return model
