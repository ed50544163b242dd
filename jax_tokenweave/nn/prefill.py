"""The prefill's attention for ``nn.forward.decoder_forward``: ragged causal attention over the
packed requests of a ``BatchPlan`` (``nn.attention.ragged_attention``).

:class:`PrefillAttention` is what a caller passes (no operands; ``keep_kv``: hand back each
layer's K/V); :class:`PrefillAttentionRank` is its per-rank attention: a later half's piece of
a request cut by the split attends to the earlier halves' K/V of that request (same layer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.nn import attention as attn_lib
from jax_tokenweave.nn.stack import concat
from jax_tokenweave.weave.plan import Half

PREFILL_IMPLS = ("auto", "xla", "cudnn")
"""A prefill attention's implementations (``auto``: ``attention.default_implementation``)."""


@dataclasses.dataclass(frozen=True)
class PrefillAttention:
    """A prefill's attention as a caller passes it to ``decoder_forward``.

    ``keep_kv``: its results are, per layer, ``(k, v)`` [T, Nkv, D] sharded over heads
    (``P(None, tp)``), RoPE applied to k; else ``()``. ``num_layers`` sizes that list.
    """

    keep_kv: bool = False
    num_layers: int = 0

    def resolve(self, requested: str, platform: str, dtype: Any, config: DecoderConfig) -> str:
        """``xla`` or ``cudnn``; ``auto`` is ``attention.default_implementation``'s choice."""
        if requested == "auto":
            return attn_lib.default_implementation(platform, dtype, config.head_dim) or "xla"
        if requested not in PREFILL_IMPLS:
            raise ValueError(
                f"a prefill's attention implementation must be one of {PREFILL_IMPLS}, got "
                f"{requested!r}"
            )
        return requested

    def operands(self) -> tuple[()]:
        return ()

    def specs(self, axis_name: str) -> tuple[Any, Any]:
        kv = P(None, axis_name, None)
        return (), ([(kv, kv)] * self.num_layers if self.keep_kv else ())

    def bind(
        self, operands: Any, halves: tuple[Half, ...], implementation: str, key_chunk: int
    ) -> PrefillAttentionRank:
        return PrefillAttentionRank(halves, implementation, keep_kv=self.keep_kv)


class PrefillAttentionRank:
    """Ragged causal attention of a prefill's halves, per rank (module docstring).

    Keeps each layer's K/V per half: a later half's piece of a request cut by the split attends
    to the earlier halves' K/V of that request (same layer). ``implementation``: ``xla`` or
    ``cudnn`` (``attention.ragged_attention``'s).
    """

    def __init__(
        self, halves: Sequence[Half], implementation: str = "xla", *, keep_kv: bool = False
    ) -> None:
        self.halves = tuple(halves)
        self.implementation: attn_lib.Implementation | None = (
            "cudnn" if implementation == "cudnn" else None
        )
        self.keep_kv = keep_kv
        self._k: dict[int, list[jax.Array]] = {}
        self._v: dict[int, list[jax.Array]] = {}

    def half_positions(self, j: int) -> np.ndarray:
        """Half ``j``'s positions inside their requests (static, from the plan)."""
        return self.halves[j].positions()

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

    def results(self) -> Any:
        """Per layer, ``(k, v)`` of all halves in token order ([T, Nkv/N, D] each) where
        ``keep_kv``; else ``()``."""
        if not self.keep_kv:
            return ()
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
