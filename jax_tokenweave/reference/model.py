"""Float64 single-device, unsharded references of ``WeaveDecoder`` and ``LlamaModel``.

They take the weights as full NumPy arrays named as ``params.named_params`` names them and
compute everything in float64 with no sharding, no split and no schedule: the ground truth every
schedule's output is compared with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.nn import attention as attn_lib
from jax_tokenweave.nn.decoder_layer import inv_frequencies
from jax_tokenweave.nn.moe import reference_moe
from jax_tokenweave.weave.plan import plan_batch


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Float64 RMSNorm over the last axis: ``x`` [..., H], ``w`` [H]."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def reference_decoder(
    weights: Mapping[str, np.ndarray],
    config: DecoderConfig,
    hidden: np.ndarray,
    request_lengths: Sequence[int],
    prefix: str = "",
) -> np.ndarray:
    """The decoder stack (any schedule that computes the model): ``hidden`` [T, H] packed as
    ``request_lengths`` -> final-normed hidden states [T, H].

    ``weights``: full arrays named as ``params.named_params`` (with ``prefix`` prepended, e.g.
    ``"decoder."``).
    """
    w = {
        k[len(prefix) :]: np.asarray(v, np.float64)
        for k, v in weights.items()
        if k.startswith(prefix)
    }
    eps, d = config.rms_norm_eps, config.head_dim
    lengths = tuple(request_lengths)
    positions = plan_batch(lengths, split=False).positions()
    inv_freq = inv_frequencies(config)
    h = np.asarray(hidden, np.float64)
    t = h.shape[0]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        x = rms_norm(h, w[p + "input_layernorm"], eps)
        q, k, v = x @ w[p + "q_proj"], x @ w[p + "k_proj"], x @ w[p + "v_proj"]
        if config.qkv_bias:
            q, k, v = q + w[p + "q_bias"], k + w[p + "k_bias"], v + w[p + "v_bias"]
        q = attn_lib.reference_rope(q.reshape(t, -1, d), positions, inv_freq)
        k = attn_lib.reference_rope(k.reshape(t, -1, d), positions, inv_freq)
        attn = attn_lib.reference_attention(q, k, v.reshape(t, -1, d), lengths)
        h = h + attn.reshape(t, -1) @ w[p + "o_proj"]
        x = rms_norm(h, w[p + "post_attention_layernorm"], eps)
        if config.num_experts > 0:
            mlp = reference_moe(
                x,
                w[p + "moe.router"],
                w[p + "moe.gate_proj"],
                w[p + "moe.up_proj"],
                w[p + "moe.down_proj"],
                config.experts_per_token,
            )
        else:
            g, u = x @ w[p + "gate_proj"], x @ w[p + "up_proj"]
            mlp = (g / (1 + np.exp(-g)) * u) @ w[p + "down_proj"]
        h = h + mlp
    return rms_norm(h, w["final_norm"], eps)


def reference_logits(
    weights: Mapping[str, np.ndarray],
    config: DecoderConfig,
    tokens: np.ndarray,
    request_lengths: Sequence[int],
) -> np.ndarray:
    """``LlamaModel``: tokens [T] packed as ``request_lengths`` -> logits [T, V] (float64)."""
    embed = np.asarray(weights["embed"], np.float64)
    hidden = embed[np.asarray(tokens)]
    out = reference_decoder(weights, config, hidden, tuple(request_lengths), prefix="decoder.")
    head = embed.T if config.tie_word_embeddings else np.asarray(weights["lm_head"], np.float64)
    return out @ head
