"""The decoder stack's one layer loop, per rank (inside ``jax.shard_map``).

:func:`run_stack` runs each layer's attention and MLP stages on one or two token halves:
``x = reducer.ready(j)``, the stage's partial, ``reducer.reduce(j, partial, next_norm_weight)``.
A schedule is only its arguments (halves, reducer, attention). An attention function is
``attention(layer, half, q, k, v) -> [T_j, Nq/N, D]`` (q/k/v ``[T_j, heads/N, D]``, RoPE
applied); one with ``fuses_rope`` has ``rope_and_attend``. The loop and its configurations:
See docs/WEAVE.md#nnstack.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np

from jax_tokenweave.nn import attention as attn_lib
from jax_tokenweave.nn.decoder_layer import inv_frequencies
from jax_tokenweave.weave.plan import Half
from jax_tokenweave.weave.reducers import Reducer


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


class PrefillAttention:
    """Ragged causal attention of a prefill's halves (``attention.ragged_attention``).

    Keeps each layer's K/V per half: a later half's piece of a request cut by the split
    attends to the earlier halves' K/V of that request (same layer); :meth:`kv` returns them.
    ``implementation``: ``attention.ragged_attention``'s (None = XLA, ``"cudnn"``).
    """

    def __init__(
        self, halves: Sequence[Half], implementation: attn_lib.Implementation | None = None
    ) -> None:
        self.halves = tuple(halves)
        self.implementation = implementation
        self._k: dict[int, list[jax.Array]] = {}
        self._v: dict[int, list[jax.Array]] = {}

    def __call__(self, layer: int, j: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        half = self.halves[j]
        ks, vs = self._k.setdefault(layer, []), self._v.setdefault(layer, [])
        prefix = _prefixes(half, ks, vs)
        ks.append(k)
        vs.append(v)
        return attn_lib.ragged_attention(
            q,
            k,
            v,
            half.pieces,
            origin=half.start,
            prefix=prefix,
            implementation=self.implementation,
        )

    def kv(self) -> list[tuple[jax.Array, jax.Array]]:
        """Per layer, ``(k, v)`` of all halves in token order: [T, Nkv/N, D] each."""
        return [(concat(self._k[i]), concat(self._v[i])) for i in sorted(self._k)]


def _prefixes(
    half: Half, earlier_k: list[jax.Array], earlier_v: list[jax.Array]
) -> Mapping[int, tuple[jax.Array, jax.Array]]:
    """K/V prefixes of ``half``'s pieces with position > 0, cut from the earlier halves' K/V,
    which cover global tokens ``[0, half.start)`` in order."""
    out = {}
    for piece in half.pieces:
        if piece.position > 0:
            if not earlier_k:
                raise ValueError(f"piece {piece} needs a K/V prefix but no earlier half exists")
            lo = piece.start - piece.position
            out[piece.request] = (
                concat(earlier_k)[lo : piece.start],
                concat(earlier_v)[lo : piece.start],
            )
    return out


def concat(parts: Sequence[jax.Array]) -> jax.Array:
    """``parts`` joined along axis 0 (no copy for a single part)."""
    return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
