"""The decoder stack's one layer loop, per rank (inside ``jax.shard_map``).

:func:`run_stack` runs each layer's attention and MLP stages on one or two token halves:
``x = reducer.ready(j)``, the stage's partial, ``reducer.reduce(j, partial, next_norm_weight)``.
A schedule is only its arguments (halves, reducer, attention). An attention function is
``attention(layer, half, q, k, v) -> [T_j, Nq/N, D]`` (q/k/v ``[T_j, heads/N, D]``, RoPE
applied); one with ``fuses_rope`` has ``rope_and_attend``. The loop and its configurations:
See docs/WEAVE.md#nnstack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np

from jax_tokenweave._deprecation import renamed_attribute
from jax_tokenweave.nn.decoder_layer import inv_frequencies
from jax_tokenweave.weave.reducers import Reducer

# Until 0.4.0 the per-rank prefill attention lived here (the caller's is nn.prefill's now).
_RENAMED = {"PrefillAttention": "jax_tokenweave.nn.prefill:PrefillAttentionRank"}


def __getattr__(name: str) -> Any:
    return renamed_attribute(__name__, name, _RENAMED)


class AttentionFn(Protocol):
    """``(layer index, half index, q, k, v) -> attention output [T_j, Nq/N, D]``."""

    def __call__(
        self, layer: int, half: int, q: jax.Array, k: jax.Array, v: jax.Array, /
    ) -> jax.Array: ...


class RopeFusingAttentionFn(AttentionFn, Protocol):
    """An attention function that applies RoPE itself where ``fuses_rope`` (module docstring):
    ``rope_and_attend(layer, half, qkv [T_j, heads, D], nq, inv_freq [D / 2])``."""

    fuses_rope: bool

    def rope_and_attend(
        self, layer: int, half: int, qkv: jax.Array, nq: int, inv_freq: np.ndarray, /
    ) -> jax.Array: ...


class RankAttention(AttentionFn, Protocol):
    """The per-rank attention of one forward (``nn.forward.StackAttention.bind``): an
    :class:`AttentionFn` that also gives each half's RoPE positions and, at the end, its
    results (what ``nn.forward.decoder_forward`` returns beside the hidden states)."""

    def half_positions(self, half: int, /) -> jax.Array | np.ndarray:
        """int32 [T_j]: half ``half``'s positions inside their requests."""
        ...

    def results(self) -> Any:
        """What the attention hands back after the last layer (caches, K/V, or ``()``)."""
        ...


def run_stack(
    dec: Any,
    inputs: Sequence[jax.Array],
    positions: Sequence[jax.Array | np.ndarray],
    reducer: Reducer,
    attention: AttentionFn,
) -> list[jax.Array]:
    """The layer loop (module docstring) on ``dec`` (a ``WeaveDecoder`` holding local shards).

    ``inputs``: per half, hidden states [T_j, H] replicated; ``positions``: per half, int32
    [T_j] positions inside their requests (for RoPE). Returns per half the final-normed hidden
    states [T_j, H], replicated.
    """
    layers = list(dec.layers)
    halves = range(len(inputs))
    reducer.begin(inputs, layers[0].input_layernorm[...])
    for i, layer in enumerate(layers):
        next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else dec.final_norm
        for j in halves:
            if getattr(attention, "fuses_rope", False):
                qkv, nq = layer.qkv_heads(reducer.ready(j))
                fusing = cast(RopeFusingAttentionFn, attention)
                attn = fusing.rope_and_attend(i, j, qkv, nq, inv_frequencies(layer.config))
            else:
                q, k, v = layer.qkv(reducer.ready(j), positions[j])
                attn = attention(i, j, q, k, v)
            reducer.reduce(j, layer.attention_out(attn), layer.post_attention_layernorm[...])
        for j in halves:
            reducer.reduce(j, layer.mlp(reducer.ready(j)), next_norm[...])
    return reducer.finish()


def concat(parts: Sequence[jax.Array]) -> jax.Array:
    """``parts`` joined along axis 0 (no copy for a single part)."""
    return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
