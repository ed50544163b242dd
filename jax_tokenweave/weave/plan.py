"""Wave-aware split planning and the ragged batch layout (pure Python, no JAX).

A batch is requests packed back to back (``T`` tokens). :func:`plan_batch` decides whether and
where to cut it into halves A = ``[0, a)`` and B = ``[a, T)`` (one half's communication overlaps
the other's compute) and returns a :class:`BatchPlan`: hashable, a static ``jit`` argument,
with the halves' pieces and the tuning table's CTA counts. A request cut by the split has a
piece in each half; B's piece attends to A's K/V of the same request. When to split, where
(work balance or the wave rule, :class:`WaveModel`, plus the table's offset) and how a cut
request is laid out: ``docs/SPLIT.md``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.weave import tuning as tuning_lib
from jax_tokenweave.weave.cost import CostModel
from jax_tokenweave.weave.tuning import DEFAULT_THRESHOLD, TuneEntry, TuneTable

if TYPE_CHECKING:
    from jax_tokenweave.config import DecoderConfig

__all__ = [
    "DEFAULT_THRESHOLD",
    "PAD_MULTIPLE",
    "BatchPlan",
    "Half",
    "Piece",
    "WaveModel",
    "midpoint",
    "plan_batch",
    "round_up",
    "wave_offset",
]

PAD_MULTIPLE = 256
"""The token count is rounded up to a multiple of this to define the midpoint."""


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= value``."""
    return ceil_div(value, multiple) * multiple


def midpoint(num_tokens: int) -> int:
    """``round_up(num_tokens, 256) // 2``: the first half's size before the offset."""
    return round_up(num_tokens, PAD_MULTIPLE) // 2


@dataclasses.dataclass(frozen=True)
class WaveModel:
    """Tile/wave model of the dominant GEMM, used to choose the split offset.

    ``num_sms``: SMs that run tiles (132 on H100 SXM / H200). ``tile_m`` x ``tile_n``: the
    GEMM's output tile. ``gemm_n``: per-rank output width of the dominant GEMM (gate/up fused:
    ``2 * intermediate_size / tp``; default 7168 = Llama-3-70B at TP 8). ``max_steps``: the
    candidates are ``mid + k * tile_m`` for ``|k| <= max_steps``.
    """

    num_sms: int = 132
    tile_m: int = 128
    tile_n: int = 256
    gemm_n: int = 7168
    max_steps: int = 4

    def __post_init__(self) -> None:
        for name in ("num_sms", "tile_m", "tile_n", "gemm_n"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"WaveModel.{name} must be an int >= 1, got {value!r}")
        if not _is_int(self.max_steps) or self.max_steps < 0:
            raise ValueError(f"WaveModel.max_steps must be an int >= 0, got {self.max_steps!r}")

    @classmethod
    def from_config(cls, config: DecoderConfig, tp: int, **overrides: int) -> WaveModel:
        """The model for ``config``'s gate/up GEMM at TP degree ``tp`` (``gemm_n = 2*I/tp``).

        ``overrides`` set the other fields (``num_sms``, ``tile_m``, ``tile_n``, ``max_steps``).
        For a mixture of experts this is one expert's GEMM (the routing is not modelled).
        """
        config.check_tensor_parallel(tp)
        return cls(gemm_n=2 * config.intermediate_size // tp, **overrides)

    def tiles(self, m: int) -> int:
        """Output tiles of a GEMM with ``m`` rows."""
        return math.ceil(m / self.tile_m) * math.ceil(self.gemm_n / self.tile_n)

    def waves(self, m: int) -> int:
        """Waves of tiles over ``num_sms`` SMs for a GEMM with ``m`` rows."""
        return math.ceil(self.tiles(m) / self.num_sms)

    def waste(self, m: int) -> int:
        """Idle tile slots in the last wave of a GEMM with ``m`` rows."""
        return self.waves(m) * self.num_sms - self.tiles(m)

    def split_cost(self, num_tokens: int, first: int) -> tuple[int, int, int]:
        """``(total waves, total waste, wave imbalance)`` of halves ``first`` and the rest."""
        second = num_tokens - first
        wa, wb = self.waves(first), self.waves(second)
        return wa + wb, self.waste(first) + self.waste(second), abs(wa - wb)


def wave_offset(num_tokens: int, wave: WaveModel | None = None) -> int:
    """The wave rule's offset from ``midpoint(num_tokens)`` (module docstring); needs T >= 2."""
    if not _is_int(num_tokens) or num_tokens < 2:
        raise ValueError(f"a split needs at least 2 tokens, got {num_tokens!r}")
    wave = WaveModel() if wave is None else wave
    mid = midpoint(num_tokens)
    best: tuple[tuple[int, ...], int] | None = None
    for k in range(-wave.max_steps, wave.max_steps + 1):
        first = mid + k * wave.tile_m
        if not 1 <= first <= num_tokens - 1:
            continue
        key = (*wave.split_cost(num_tokens, first), abs(k), k)
        if best is None or key < best[0]:
            best = (key, first)
    first = num_tokens // 2 if best is None else best[1]
    return first - mid


@dataclasses.dataclass(frozen=True)
class Piece:
    """A run of consecutive tokens of one request inside one half."""

    request: int  # index into BatchPlan.request_lengths
    start: int  # global index (0..T) of the piece's first token in the packed batch
    length: int  # tokens in this piece, >= 1
    position: int  # position inside its request of the piece's first token (0 unless this is
    # the second part of a request the split cut)

    @property
    def end(self) -> int:
        """Global index one past the piece's last token."""
        return self.start + self.length

    @property
    def prefix(self) -> int:
        """Tokens of the same request in earlier halves (its K/V prefix); equals ``position``."""
        return self.position

    def positions(self) -> np.ndarray:
        """int32 ``[length]``: the position inside its request of each token."""
        return np.arange(self.position, self.position + self.length, dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class Half:
    """A contiguous range of the packed batch and the request pieces in it."""

    start: int  # global index of the half's first token
    length: int  # tokens in the half
    pieces: tuple[Piece, ...]  # in token order; lengths sum to `length`

    @property
    def end(self) -> int:
        """Global index one past the half's last token."""
        return self.start + self.length

    def positions(self) -> np.ndarray:
        """int32 ``[length]``: each token's position inside its request."""
        return _concat([p.positions() for p in self.pieces])

    def segment_ids(self) -> np.ndarray:
        """int32 ``[length]``: each token's request index (global, into ``request_lengths``)."""
        return _concat([np.full(p.length, p.request, np.int32) for p in self.pieces])

    def prefix_lengths(self) -> np.ndarray:
        """int32 ``[length]``: per token, tokens of its request in earlier halves."""
        return _concat([np.full(p.length, p.prefix, np.int32) for p in self.pieces])


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Packed ragged batch layout and split decision (hashable: a valid static jit argument)."""

    request_lengths: tuple[int, ...]
    num_tokens: int  # sum(request_lengths)
    halves: tuple[Half, ...]  # one (no split) or two (split); contiguous, covering [0, T)
    offset: int  # offset applied to the midpoint (0 when not split)
    tuning: TuneEntry | None = None  # the tuning table's entry: the fused kernel's CTA counts

    @property
    def is_split(self) -> bool:
        """Whether the batch is split in two halves."""
        return len(self.halves) == 2

    @property
    def cut_request(self) -> int | None:
        """The request with a piece in both halves, if any."""
        if not self.is_split:
            return None
        first, second = self.halves
        if first.pieces[-1].request == second.pieces[0].request:
            return second.pieces[0].request
        return None

    @property
    def half_lengths(self) -> tuple[int, ...]:
        """Tokens per half."""
        return tuple(h.length for h in self.halves)

    def positions(self) -> np.ndarray:
        """int32 ``[T]``: each token's position inside its request."""
        lengths = np.asarray(self.request_lengths, np.int64)
        starts = np.cumsum(lengths) - lengths
        return (np.arange(self.num_tokens) - np.repeat(starts, lengths)).astype(np.int32)

    def segment_ids(self) -> np.ndarray:
        """int32 ``[T]``: each token's request index."""
        return np.repeat(np.arange(len(self.request_lengths), dtype=np.int32), self.request_lengths)


def plan_batch(
    request_lengths: Sequence[int],
    *,
    tp: int = 1,
    threshold: int | None = None,
    wave: WaveModel | None = None,
    offset: int | None = None,
    split: bool | None = None,
    model: str | None = None,
    config: DecoderConfig | None = None,
    table: TuneTable | None = None,
    cost: CostModel | None = None,
) -> BatchPlan:
    """Plan the packed layout of a ragged batch, its split and its tuning (docs/SPLIT.md).

    ``request_lengths``: tokens per request (ints >= 1); ``tp``: TP degree. ``threshold``: split
    iff ``T >= threshold`` when ``split`` is None (default: the table's). ``wave``: default
    ``WaveModel.from_config(config, tp)``, else ``WaveModel()``. ``offset``: wins over the rule
    and the table. ``model``: the table's name (default: by ``config``'s shapes, else ``*``).
    ``config``: for the work-balance rule (``cost`` overrides its model); ``table``: default the
    shipped one. Raises ``ValueError`` on bad inputs or an offset that leaves a half empty.
    """
    lengths = _check_lengths(request_lengths)
    if not _is_int(tp) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    if threshold is not None and (not _is_int(threshold) or threshold < 2):
        raise ValueError(f"threshold must be an int >= 2, got {threshold!r}")
    if split is not None and not isinstance(split, bool):
        raise ValueError(f"split must be None, True or False, got {split!r}")
    if offset is not None and not _is_int(offset):
        raise ValueError(f"offset must be an int or None, got {offset!r}")
    table = tuning_lib.shipped() if table is None else table
    if model is None and config is not None:
        model = table.model_name(config)
    total = sum(lengths)
    entry = table.entry(model, int(tp), total)
    if threshold is None:
        threshold = table.threshold(model, int(tp))
    do_split = total >= threshold if split is None else split
    if do_split and total < 2:
        raise ValueError(f"cannot split a batch of {total} token(s); a split needs at least 2")

    if not do_split:
        whole = Half(0, total, _pieces(lengths, 0, total))
        return BatchPlan(lengths, total, (whole,), 0, entry)

    mid = midpoint(total)
    if offset is None:
        if wave is None and config is not None:
            wave = WaveModel.from_config(config, int(tp))
        if cost is None and config is not None:
            cost = CostModel.from_config(config, int(tp), tile_m=(wave or WaveModel()).tile_m)
        rule = (
            cost.balanced_split(lengths, waves=wave)
            if cost is not None
            else mid + wave_offset(total, wave)
        )
        tuned = rule + (entry.offset or 0)
        offset = (tuned if 1 <= tuned <= total - 1 else rule) - mid
    offset = int(offset)
    first = mid + offset
    if not 1 <= first <= total - 1:
        raise ValueError(
            f"offset {offset} puts the split at token {first} of {total} (midpoint "
            f"{mid}); both halves must be non-empty, so the offset must lie in "
            f"[{1 - mid}, {total - 1 - mid}]"
        )
    halves = (
        Half(0, first, _pieces(lengths, 0, first)),
        Half(first, total - first, _pieces(lengths, first, total)),
    )
    return BatchPlan(lengths, total, halves, offset, entry)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_lengths(request_lengths: Sequence[int]) -> tuple[int, ...]:
    try:
        values = list(request_lengths)
    except TypeError:
        raise ValueError(
            f"request_lengths must be a sequence of ints, got {request_lengths!r}"
        ) from None
    if not values:
        raise ValueError("empty batch: request_lengths has no requests")
    for i, value in enumerate(values):
        if not _is_int(value):
            raise ValueError(f"request {i} has a non-integer length {value!r}")
        if value < 1:
            raise ValueError(f"request {i} has length {value}; every request needs >= 1 token")
    return tuple(int(v) for v in values)


def _pieces(lengths: tuple[int, ...], lo: int, hi: int) -> tuple[Piece, ...]:
    """The pieces of the requests that overlap the global token range ``[lo, hi)``."""
    pieces = []
    start = 0
    for request, length in enumerate(lengths):
        end = start + length
        a, b = max(start, lo), min(end, hi)
        if a < b:
            pieces.append(Piece(request, a, b - a, a - start))
        if end >= hi:
            break
        start = end
    return tuple(pieces)


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
