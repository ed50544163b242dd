"""A scheduled step -> its static layout and its packed input arrays (host side, NumPy).

Rows ``R = layout.rows``: ``[0, D)`` the decode segment, ``[D, R)`` prompt chunks on ``tile``
boundaries; a decode-only step has ``R = D``. ``tables`` [D + (R - D)/tile, table_width]: one
block table per attention group. Padding rows: position 0, zero table, cache slot
``num_blocks * block_size`` (writes dropped). The layout's split: ``plan_batch([R])``.
Row layout and split rule: docs/SERVING.md#servingrunnerbatch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.serving.buckets import decode_only_rows, decode_rows, step_rows
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.sampling import processors, prompt_logprobs
from jax_tokenweave.serving.scheduling.scheduler import ScheduledStep
from jax_tokenweave.weave import tuning
from jax_tokenweave.weave.plan import BatchPlan, WaveModel, midpoint, plan_batch


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Static shape of a step (hashable). ``samples``: sampled rows (static count)."""

    decode_rows: int
    rows: int
    tile: int
    samples: int
    plan: BatchPlan

    @property
    def groups(self) -> int:
        """Attention groups: decode rows plus chunk tiles."""
        return self.decode_rows + (self.rows - self.decode_rows) // self.tile

    @property
    def decode_only(self) -> bool:
        """Whether every row is a decode row (no prompt chunk)."""
        return self.rows == self.decode_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepArrays:
    """The step's inputs (NumPy; module docstring). ``token_source`` int32 [R]: -1 where the
    row's token is ``tokens[r]``, else its index among the previous step's sampled tokens (still
    on the device). ``sample_rows`` [S]: the row of each sampled request; the sampling fields
    [S] per sampled row (``seeds`` uint32, ``counters``: tokens the request made so far);
    ``want_logprobs`` bool []: some row asked for log-probabilities. ``processor_slots`` int32
    [S] (padding: ``max_num_seqs``), ``penalties`` float32 [S, 3] (presence, frequency,
    repetition), ``processed`` bool []: ``serving.sampling.processors``'. ``prompt_targets`` int32
    [R]: the next prompt token where the row's request asked for prompt log-probabilities, else -1
    (``want_prompt_logprobs`` bool []: any)."""

    tokens: np.ndarray
    token_source: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    tables: np.ndarray
    sample_rows: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    seeds: np.ndarray
    counters: np.ndarray
    want_logprobs: np.ndarray
    processor_slots: np.ndarray
    penalties: np.ndarray
    processed: np.ndarray
    prompt_targets: np.ndarray
    want_prompt_logprobs: np.ndarray


@functools.lru_cache(maxsize=256)
def make_layout(
    decode: int, rows: int, cfg: EngineConfig, model: DecoderConfig, tp: int
) -> StepLayout:
    """The layout of a step of ``rows`` rows whose decode segment has ``decode`` rows."""
    tile = cfg.prefill_tile
    name = tuning.model_name(model)
    split = None if cfg.schedule == "weave" and rows >= 2 * tile else False
    offset = cfg.tuning.offset if cfg.tuning is not None else None
    kwargs: dict[str, Any] = dict(tp=tp, model=name, wave=WaveModel.from_config(model, tp))
    plan = plan_batch([rows], threshold=cfg.split_threshold, split=split, offset=offset, **kwargs)
    if plan.is_split and plan.halves[1].start % tile:
        first = min(max(round(plan.halves[1].start / tile) * tile, tile), rows - tile)
        plan = plan_batch([rows], split=True, offset=first - midpoint(rows), **kwargs)
    samples = min(cfg.max_num_seqs, decode + (rows - decode) // tile)
    return StepLayout(decode, rows, tile, samples, plan)


def step_shape(num_decodes: int, chunk_rows: int, cfg: EngineConfig) -> tuple[int, int]:
    """``(decode rows, rows)`` of a step of ``num_decodes`` decodes and ``chunk_rows`` rows of
    prompt chunks (whole tiles): its layout's buckets (``serving.buckets``)."""
    tile = cfg.prefill_tile
    if num_decodes and not chunk_rows:
        return (decode_only_rows(num_decodes, tile),) * 2
    decode = decode_rows(num_decodes, tile)
    return decode, step_rows(decode + chunk_rows, cfg.max_num_batched_tokens, tile)


def pack(
    step: ScheduledStep, cfg: EngineConfig, model: DecoderConfig, tp: int
) -> tuple[StepLayout, StepArrays]:
    """Lay ``step`` out (module docstring) and fill its arrays (NumPy, no per-token loop)."""
    tile, bs, width = cfg.prefill_tile, cfg.block_size, cfg.table_width
    decodes, chunks = step.decodes, step.chunks
    lengths = np.fromiter((c.length for c in chunks), np.int64, len(chunks))
    tiles = ceil_div(lengths, tile)  # [C]
    decode, rows = step_shape(len(decodes), int(tiles.sum()) * tile, cfg)
    layout = make_layout(decode, rows, cfg, model, tp)
    r, s = layout.rows, layout.samples
    tokens, positions = np.zeros(r, np.int32), np.zeros(r, np.int32)
    source = np.full(r, -1, np.int32)
    slots = np.full(r, cfg.num_blocks * bs, np.int32)
    tables = np.zeros((layout.groups, width), np.int32)
    sample_rows = np.zeros(s, np.int32)

    n = len(decodes)
    if n:
        pos = np.asarray(step.positions, np.int64)
        tables[:n] = np.stack([q.table_row(width) for q in decodes])
        tokens[:n] = step.tokens
        source[:n] = step.sources
        positions[:n] = pos
        slots[:n] = tables[np.arange(n), pos // bs] * bs + pos % bs
        sample_rows[:n] = np.arange(n)
    if chunks:
        starts = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
        first = chunk_first_rows(step, layout)  # [C]
        chunk = np.repeat(np.arange(len(chunks)), lengths)  # [T] chunk of each token
        offset = np.arange(chunk.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        token_rows, pos = first[chunk] + offset, starts[chunk] + offset  # [T]
        chunk_tables = np.stack([c.seq.table_row(width) for c in chunks])  # [C, W]
        tokens[token_rows] = np.concatenate(
            [c.seq.prefill_array()[c.start : c.start + c.length] for c in chunks]
        )
        positions[token_rows] = pos
        slots[token_rows] = chunk_tables[chunk, pos // bs] * bs + pos % bs
        tables[decode : decode + int(tiles.sum())] = chunk_tables[
            np.repeat(np.arange(len(chunks)), tiles)
        ]
        last = np.fromiter((c.last for c in chunks), bool, len(chunks))
        sample_rows[n : n + int(last.sum())] = (first + lengths - 1)[last]

    sampled = step.sampled
    k = len(sampled)
    temperature, top_p = np.zeros(s, np.float32), np.ones(s, np.float32)
    top_k, counters = np.zeros(s, np.int32), np.zeros(s, np.int32)
    seeds = np.zeros(s, np.uint32)
    if k:
        temperature[:k] = [q.params.temperature for q in sampled]
        top_p[:k] = [q.params.top_p for q in sampled]
        top_k[:k] = [max(q.params.top_k, 0) for q in sampled]
        seeds[:k] = [q.seed % (1 << 32) for q in sampled]
        counters[:k] = step.counters
    want = np.asarray(any(q.params.logprobs is not None for q in sampled))
    processor_slots, penalties, processed = _processor_rows(step, s, cfg.max_num_seqs)
    targets, asked = prompt_logprobs.targets(chunks, chunk_first_rows(step, layout), r)
    return layout, StepArrays(
        tokens,
        source,
        positions,
        slots,
        tables,
        sample_rows,
        temperature,
        top_p,
        top_k,
        seeds,
        counters,
        want,
        processor_slots,
        penalties,
        processed,
        targets,
        np.asarray(bool(asked)),
    )


def chunk_first_rows(step: ScheduledStep, layout: StepLayout) -> np.ndarray:
    """The first row of each of ``step``'s prompt chunks in ``layout`` (int64 [C])."""
    lengths = np.fromiter((c.length for c in step.chunks), np.int64, len(step.chunks))
    tiles = ceil_div(lengths, layout.tile)
    return layout.decode_rows + layout.tile * (np.cumsum(tiles) - tiles)


def _processor_rows(
    step: ScheduledStep, samples: int, sink: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``slots`` [S], ``penalties`` [S, 3] and ``processed`` [] of ``step``'s sampled rows."""
    slots = np.full(samples, sink, np.int32)
    penalties = np.tile(np.asarray([0.0, 0.0, 1.0], np.float32), (samples, 1))
    sampled = step.sampled
    if not any(c < q.processed_until for q, c in zip(sampled, step.counters, strict=True)):
        return slots, penalties, np.asarray(False)
    for i, q in enumerate(sampled):
        p = q.params
        if processors.needs_slot(p):  # the others read the sink's row: no bias, no effect
            slots[i] = q.slot
            penalties[i] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
    return slots, penalties, np.asarray(True)


def pack_padding(layout: StepLayout, cfg: EngineConfig) -> StepArrays:
    """Arrays of ``layout`` with padding rows only (they write nothing): for compiling."""
    r, s = layout.rows, layout.samples
    zeros = lambda n, dtype=np.int32: np.zeros(n, dtype)
    return StepArrays(
        zeros(r),
        np.full(r, -1, np.int32),
        zeros(r),
        np.full(r, cfg.num_blocks * cfg.block_size, np.int32),
        np.zeros((layout.groups, cfg.table_width), np.int32),
        zeros(s),
        zeros(s, np.float32),
        np.ones(s, np.float32),
        zeros(s),
        zeros(s, np.uint32),
        zeros(s),
        np.asarray(False),
        np.full(s, cfg.max_num_seqs, np.int32),
        np.tile(np.asarray([0.0, 0.0, 1.0], np.float32), (s, 1)),
        np.asarray(False),
        np.full(r, -1, np.int32),
        np.asarray(False),
    )
