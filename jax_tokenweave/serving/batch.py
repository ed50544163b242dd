"""A scheduled step -> its static layout and its packed input arrays (host side, NumPy).

Rows of the packed batch (``R = layout.rows``):

====================== ================================================================
rows                   content
====================== ================================================================
``[0, D)``             decode segment, ``D = layout.decode_rows``: one token per decoding
                       request (its latest token), then padding rows
``[D, R)``             prompt chunks, each starting on a ``tile`` boundary (relative to
                       ``D``), padded to whole tiles, then padding tiles
====================== ================================================================

Attention groups (one block table each): every decode row is its own group; every tile of the
chunk segment is one group (a tile never holds two requests). ``tables [D + (R - D)/tile,
table_width]``. Padding rows have position 0, a zero block table and the out-of-range cache
slot ``num_blocks * block_size`` (their K/V writes are dropped); their outputs are ignored.

The layout is static (a ``jit`` argument); its split comes from ``split.plan_batch([R])``: the
split threshold (``EngineConfig.split_threshold``, default the tuning table's for the model and
TP degree), the wave rule of the model's shapes plus the table's offset, moved to a tile
boundary where needed so the two halves cut no tile. The requests inside a step change from
step to step, so the work-balance rule (which needs the request lengths) is not used; the
plan's ``tuning`` entry (the fused kernel's CTA counts) is the table's for ``R`` tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jax_tokenweave import tuning
from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.serving.buckets import decode_rows, step_rows
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.scheduler import ScheduledStep
from jax_tokenweave.split import BatchPlan, WaveModel, midpoint, plan_batch


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepArrays:
    """The step's inputs (NumPy; module docstring). ``sample_rows`` [S] row per sampled
    request, the sampling fields [S] per sampled row (``seeds`` uint32, ``counters``: tokens
    the request made so far, the index into its random stream)."""

    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    tables: np.ndarray
    sample_rows: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    seeds: np.ndarray
    counters: np.ndarray


@functools.lru_cache(maxsize=256)
def make_layout(decode: int, rows: int, cfg: EngineConfig, model: DecoderConfig,
                tp: int) -> StepLayout:
    """The layout of a step of ``rows`` rows whose decode segment has ``decode`` rows."""
    tile = cfg.prefill_tile
    name = tuning.model_name(model)
    split = None if cfg.schedule == "weave" and rows >= 2 * tile else False
    offset = cfg.tuning.offset if cfg.tuning is not None else None
    kwargs = dict(tp=tp, model=name, wave=WaveModel.from_config(model, tp))
    plan = plan_batch([rows], threshold=cfg.split_threshold, split=split, offset=offset,
                      **kwargs)
    if plan.split and plan.halves[1].start % tile:
        first = min(max(round(plan.halves[1].start / tile) * tile, tile), rows - tile)
        plan = plan_batch([rows], split=True, offset=first - midpoint(rows), **kwargs)
    samples = min(cfg.max_num_seqs, decode + (rows - decode) // tile)
    return StepLayout(decode, rows, tile, samples, plan)


def pack(step: ScheduledStep, cfg: EngineConfig, model: DecoderConfig,
         tp: int) -> tuple[StepLayout, StepArrays]:
    """Lay ``step`` out (module docstring) and fill its arrays."""
    tile, bs = cfg.prefill_tile, cfg.block_size
    decode = decode_rows(len(step.decodes), tile)
    used = decode + sum(-(-c.length // tile) * tile for c in step.chunks)
    layout = make_layout(decode, step_rows(used, cfg.max_num_batched_tokens, tile), cfg, model,
                         tp)
    r, s = layout.rows, layout.samples
    tokens, positions = np.zeros(r, np.int32), np.zeros(r, np.int32)
    slots = np.full(r, cfg.num_blocks * bs, np.int32)
    tables = np.zeros((layout.groups, cfg.table_width), np.int32)
    sample_rows = np.zeros(s, np.int32)

    def place(row: int, seq_blocks: list[int], token: int, position: int) -> None:
        tokens[row], positions[row] = token, position
        slots[row] = seq_blocks[position // bs] * bs + position % bs

    for i, seq in enumerate(step.decodes):
        pos = seq.num_computed
        place(i, seq.blocks, seq.output[-1], pos)
        tables[i, :len(seq.blocks)] = seq.blocks
        sample_rows[i] = i
    n_sampled, row = len(step.decodes), decode
    for chunk in step.chunks:
        seq = chunk.seq
        for j in range(chunk.length):
            place(row + j, seq.blocks, seq.prompt[chunk.start + j], chunk.start + j)
        tiles = -(-chunk.length // tile)
        group = decode + (row - decode) // tile
        tables[group:group + tiles, :len(seq.blocks)] = seq.blocks
        if chunk.last:
            sample_rows[n_sampled] = row + chunk.length - 1
            n_sampled += 1
        row += tiles * tile

    sampled = step.sampled
    temperature, top_p = np.zeros(s, np.float32), np.ones(s, np.float32)
    top_k, counters = np.zeros(s, np.int32), np.zeros(s, np.int32)
    seeds = np.zeros(s, np.uint32)
    for i, seq in enumerate(sampled):
        p = seq.params
        temperature[i], top_p[i], top_k[i] = p.temperature, p.top_p, max(p.top_k, 0)
        seeds[i], counters[i] = seq.seed % (1 << 32), len(seq.output)
    return layout, StepArrays(tokens, positions, slots, tables, sample_rows, temperature,
                              top_p, top_k, seeds, counters)


def pack_padding(layout: StepLayout, cfg: EngineConfig) -> StepArrays:
    """Arrays of ``layout`` with padding rows only (they write nothing): for compiling."""
    r, s = layout.rows, layout.samples
    zeros = lambda n, dtype=np.int32: np.zeros(n, dtype)
    return StepArrays(zeros(r), zeros(r), np.full(r, cfg.num_blocks * cfg.block_size, np.int32),
                      np.zeros((layout.groups, cfg.table_width), np.int32), zeros(s),
                      zeros(s, np.float32), np.ones(s, np.float32), zeros(s), zeros(s, np.uint32),
                      zeros(s))
