"""A work model of the two halves, to place the split where their work balances.

:meth:`CostModel.balanced_split` moves the split to where the halves' work (GEMM FLOPs per
token + causal attention FLOPs per (query, key) pair, the second half attending to the first
half's keys too) is equal, on a multiple of the GEMM tile. The formulas and why (ISO's case):
See docs/WEAVE.md#weavecost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax_tokenweave.kernel._util import ceil_div


@dataclasses.dataclass(frozen=True)
class CostModel:
    """FLOPs per rank and layer: ``gemm_flops_per_token`` and ``attention_flops_per_pair``
    (module docstring); ``tile_m``: the split point is kept on a multiple of it."""

    gemm_flops_per_token: float
    attention_flops_per_pair: float
    tile_m: int = 128

    def __post_init__(self) -> None:
        if not self.gemm_flops_per_token > 0 or not self.attention_flops_per_pair >= 0:
            raise ValueError(
                f"CostModel needs positive GEMM and non-negative attention FLOPs, "
                f"got {self.gemm_flops_per_token}, {self.attention_flops_per_pair}"
            )
        if not isinstance(self.tile_m, int) or self.tile_m < 1:
            raise ValueError(f"tile_m must be an int >= 1, got {self.tile_m!r}")

    @classmethod
    def from_config(cls, config: Any, tp: int, *, tile_m: int = 128) -> CostModel:
        """The model of a ``DecoderConfig``'s layer at TP degree ``tp``."""
        config.check_tensor_parallel(tp)
        h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
        nq, nkv = config.num_heads * d, config.num_kv_heads * d
        experts = max(config.num_experts, 1)
        gemm = 2 * h * (nq + 2 * nkv) / tp + 2 * nq * h / tp + 6 * h * f * experts / tp
        if config.num_experts:
            gemm += 2 * h * config.num_experts
        return cls(gemm, 4 * nq / tp, tile_m)

    def piece_cost(self, length: int, prefix: int = 0) -> float:
        """Work of ``length`` tokens of one request after ``prefix`` of its tokens."""
        pairs = length * prefix + length * (length + 1) / 2
        return self.gemm_flops_per_token * length + self.attention_flops_per_pair * pairs

    def half_costs(self, request_lengths: Sequence[int], first: int) -> tuple[float, float]:
        """Work of the halves ``[0, first)`` and ``[first, T)`` of the packed batch."""
        a = b = 0.0
        start = 0
        for length in request_lengths:
            end = start + length
            in_a = min(max(first - start, 0), length)
            if in_a:
                a += self.piece_cost(in_a)
            if length - in_a:
                b += self.piece_cost(length - in_a, in_a)
            start = end
        return a, b

    def balanced_split(self, request_lengths: Sequence[int], *, waves: Any | None = None) -> int:
        """The first half's size: the multiple of ``tile_m`` next to the work-balance point
        (the lower or the upper one, whichever leaves the larger half's work smaller; on a tie,
        fewer GEMM waves by ``waves`` (a ``weave.plan.WaveModel``), then the one nearer the token
        midpoint). Where no multiple of ``tile_m`` lies in ``[1, T-1]``, the balance point
        itself. Needs ``T >= 2``."""
        total = sum(request_lengths)
        if total < 2:
            raise ValueError(f"a split needs at least 2 tokens, got {total}")
        lo, hi = 1, total - 1  # first index where A's work >= B's
        while lo < hi:
            mid = (lo + hi) // 2
            a, b = self.half_costs(request_lengths, mid)
            lo, hi = (lo, mid) if a >= b else (mid + 1, hi)
        candidates = {lo - 1, lo} if lo > 1 else {lo}
        tile = self.tile_m
        aligned = {(c // tile) * tile for c in candidates} | {
            ceil_div(c, tile) * tile for c in candidates
        }
        aligned = {c for c in aligned if 1 <= c <= total - 1}
        pool = aligned or candidates

        def key(first: int) -> tuple:
            bottleneck = max(self.half_costs(request_lengths, first))
            wave_count = 0 if waves is None else waves.waves(first) + waves.waves(total - first)
            return round(bottleneck, 6), wave_count, abs(2 * first - total), first

        return min(pool, key=key)
