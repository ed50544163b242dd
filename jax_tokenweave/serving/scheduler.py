"""Continuous batching with chunked prefill (host side, pure Python).

Requests wait in arrival order (FCFS). Each step (:meth:`Scheduler.schedule`) is made of

1. one token of every running request whose prompt is fully in the cache (a *decode*); the
   decode segment takes ``buckets.decode_rows(D)`` rows;
2. then, while rows of the budget remain: the next chunk of every running request whose prompt
   is partly in the cache, then newly admitted waiting requests' first chunks. A chunk takes
   ``min(prompt left, rows left)`` tokens and ``round_up(chunk, prefill_tile)`` rows (chunks
   start on tile boundaries).

Admission control: a waiting request is admitted when fewer than ``max_num_seqs`` run and the
allocator can give it every block it may ever need (``prompt + max_tokens - 1`` positions), so
a running request never runs out of cache and nothing is preempted. The head of the queue
blocks the ones behind it (FCFS). A request that could never fit (longer than
``max_model_len`` or than the whole cache) is refused by :meth:`Scheduler.add` with a
``ValueError``. A finished request's blocks are freed at once (:meth:`Scheduler.finish`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

import numpy as np

from jax_tokenweave.serving.blocks import BlockAllocator
from jax_tokenweave.serving.buckets import decode_rows
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.sampling_params import SamplingParams


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's state. ``num_computed``: its tokens whose K/V are in the cache."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    output: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    _prompt_array: np.ndarray | None = dataclasses.field(default=None, init=False, repr=False)
    _table: tuple[list[int], np.ndarray] | None = dataclasses.field(default=None, init=False,
                                                                      repr=False)

    def prompt_array(self) -> np.ndarray:
        """The prompt as int32 [len(prompt)] (made once)."""
        if self._prompt_array is None:
            self._prompt_array = np.asarray(self.prompt, np.int32)
        return self._prompt_array

    def table_row(self, width: int) -> np.ndarray:
        """The block table as int32 [width], zero-padded (made again when ``blocks`` is
        replaced)."""
        cached = self._table
        if cached is None or cached[0] is not self.blocks or cached[1].shape[0] != width:
            row = np.zeros(width, np.int32)
            row[:len(self.blocks)] = self.blocks
            self._table = cached = (self.blocks, row)
        return cached[1]

    @property
    def prefilled(self) -> bool:
        """Whether the whole prompt is in the cache (the request decodes)."""
        return self.num_computed >= len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def positions_needed(self) -> int:
        """Cache positions it may ever use: the prompt and every new token but the last."""
        return len(self.prompt) + self.params.max_tokens - 1


@dataclasses.dataclass(frozen=True)
class Chunk:
    """``length`` prompt tokens of ``seq`` from position ``start``; ``last``: it completes the
    prompt (its last row is sampled)."""

    seq: Sequence
    start: int
    length: int

    @property
    def last(self) -> bool:
        return self.start + self.length == len(self.seq.prompt)


@dataclasses.dataclass(frozen=True)
class ScheduledStep:
    """What one step computes: ``decodes`` (one token each) and prompt ``chunks``."""

    decodes: tuple[Sequence, ...]
    chunks: tuple[Chunk, ...]

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.chunks

    @property
    def sampled(self) -> tuple[Sequence, ...]:
        """The requests that get a new token from this step, in sample-row order."""
        return self.decodes + tuple(c.seq for c in self.chunks if c.last)


class Scheduler:
    """FCFS continuous batching with chunked prefill over a paged cache (module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.allocator = BlockAllocator(config.num_blocks, config.block_size)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """``ValueError`` where a request of this size could never run."""
        cfg, needed = self.config, prompt_len + max_tokens - 1
        if prompt_len + max_tokens > cfg.max_model_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len ({cfg.max_model_len})")
        blocks = self.allocator.blocks_for(needed)
        if blocks > cfg.num_blocks:
            raise ValueError(f"the request needs {blocks} KV cache blocks of {cfg.block_size} "
                             f"positions but the cache has only {cfg.num_blocks} (num_blocks)")

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (``ValueError`` where it could never fit, see :meth:`check_fits`)."""
        self.check_fits(len(seq.prompt), seq.params.max_tokens)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        """The next step (module docstring); admits waiting requests as blocks allow."""
        cfg, tile = self.config, self.config.prefill_tile
        decodes = tuple(s for s in self.running if s.prefilled)
        room = cfg.max_num_batched_tokens - decode_rows(len(decodes), tile)
        chunks: list[Chunk] = []

        def take(seq: Sequence) -> None:
            nonlocal room
            length = min(len(seq.prompt) - seq.num_computed, room)
            chunks.append(Chunk(seq, seq.num_computed, length))
            room -= -(-length // tile) * tile

        for seq in self.running:
            if not seq.prefilled and room >= tile:
                take(seq)
        while self.waiting and room >= tile and len(self.running) < cfg.max_num_seqs:
            head = self.waiting[0]
            need = self.allocator.blocks_for(head.positions_needed())
            if not self.allocator.can_allocate(need):
                break
            head.blocks = self.allocator.allocate(need)
            self.running.append(self.waiting.popleft())
            take(head)
        return ScheduledStep(decodes, tuple(chunks))

    def update(self, step: ScheduledStep, tokens: Iterable[int]) -> list[Sequence]:
        """Advance the step's requests: their cached tokens, and ``tokens`` (one per
        ``step.sampled``) appended; finishes those that hit a stop token or ``max_tokens``.
        Returns the requests that got a token, in ``step.sampled`` order (an aborted one
        gets none)."""
        for seq in step.decodes:
            seq.num_computed += 1
        for chunk in step.chunks:
            chunk.seq.num_computed += chunk.length
        sampled = step.sampled
        tokens = list(tokens)
        if len(tokens) != len(sampled):
            raise ValueError(f"got {len(tokens)} tokens for {len(sampled)} sampled requests")
        for seq, token in zip(sampled, tokens, strict=True):
            if seq.finished:  # aborted while the step ran
                continue
            seq.output.append(int(token))
            if int(token) in seq.stop_ids:
                self.finish(seq, "stop")
            elif len(seq.output) >= seq.params.max_tokens:
                self.finish(seq, "length")
        return [seq for seq in sampled if seq.finish_reason != "abort"]

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish ``seq`` with ``reason`` and free its blocks now (also for a waiting one)."""
        if seq.finished:
            return
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.blocks)
        seq.blocks = []
