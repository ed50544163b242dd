"""Continuous batching with chunked prefill (host side, pure Python), FCFS.

:meth:`Scheduler.schedule` makes a step: one decode token per running request that may make more,
then prompt chunks (partly prefilled requests first, then newly admitted ones) up to
``max_num_batched_tokens`` rows. Admission reserves every block a request may need: nothing is
preempted. :meth:`Scheduler.add` raises ``ValueError`` for a request that can never fit;
:meth:`Scheduler.update` takes a step's tokens later (async scheduling). The rules:
docs/SERVING.md#servingscheduler.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

import numpy as np

from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.serving.blocks import BlockAllocator
from jax_tokenweave.serving.buckets import decode_rows
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.sampling_params import SamplingParams


@dataclasses.dataclass(eq=False)
class Request:
    """One request's state (one sample of it: ``n`` samples are ``n`` of these with one
    ``request_id``). ``num_computed``: its positions whose K/V are in the cache or
    written by a scheduled step; ``num_pending``: its tokens sampled by scheduled steps whose
    tokens have not arrived; ``in_flight``: scheduled steps holding it, not yet updated."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    index: int = 0  # which sample of its request (SamplingParams.n)
    output: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    num_pending: int = 0
    in_flight: int = 0
    sample_step: int = -1  # serial of the last step that samples it,
    sample_step_index: int = -1  # and its index among that step's sampled requests
    _prompt_array: np.ndarray | None = dataclasses.field(default=None, init=False, repr=False)
    _table: tuple[list[int], np.ndarray] | None = dataclasses.field(
        default=None, init=False, repr=False
    )

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
            row[: len(self.blocks)] = self.blocks
            self._table = cached = (self.blocks, row)
        return cached[1]

    @property
    def prefilled(self) -> bool:
        """Whether the whole prompt is scheduled (the request decodes)."""
        return self.num_computed >= len(self.prompt)

    @property
    def num_made(self) -> int:
        """New tokens made or in flight."""
        return len(self.output) + self.num_pending

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

    seq: Request
    start: int
    length: int

    @property
    def last(self) -> bool:
        return self.start + self.length == len(self.seq.prompt)


@dataclasses.dataclass(frozen=True)
class ScheduledStep:
    """What one step computes: ``decodes`` (one token each) and prompt ``chunks``.

    Per decode: ``positions`` (its input token's), ``tokens`` (the input token where the host
    has it), ``sources`` (-1: ``tokens``; else its index among the previous step's sampled
    tokens, the input token still on the device). Per sampled request: ``counters`` (tokens it
    made before this one: the index into its random stream)."""

    decodes: tuple[Request, ...]
    chunks: tuple[Chunk, ...]
    positions: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    sources: tuple[int, ...] = ()
    counters: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.chunks

    @property
    def sampled(self) -> tuple[Request, ...]:
        """The requests that get a new token from this step, in sample-row order."""
        return self.decodes + tuple(c.seq for c in self.chunks if c.last)

    @property
    def seqs(self) -> tuple[Request, ...]:
        """Every request with rows in the step (each once)."""
        return self.decodes + tuple(c.seq for c in self.chunks)


class Scheduler:
    """FCFS continuous batching with chunked prefill over a paged cache (module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.allocator = BlockAllocator(config.num_blocks, config.block_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.deferred: set[Request] = set()  # finished, blocks held by unprocessed steps
        self._serial = 0  # non-empty steps scheduled

    def check_fits(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        """``ValueError`` where a request of this size (``n`` samples) could never run."""
        cfg, needed = self.config, prompt_len + max_tokens - 1
        if prompt_len + max_tokens > cfg.max_model_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({cfg.max_model_len})"
            )
        blocks = self.allocator.blocks_for(needed) * n
        if blocks > cfg.num_blocks:
            raise ValueError(
                f"the request needs {blocks} KV cache blocks of {cfg.block_size} "
                f"positions but the cache has only {cfg.num_blocks} (num_blocks)"
            )

    def add(self, seq: Request) -> None:
        """Queue ``seq`` (``ValueError`` where it could never fit, see :meth:`check_fits`)."""
        self.check_fits(len(seq.prompt), seq.params.max_tokens)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or blocks not yet freed."""
        return bool(self.waiting or self.running or self.deferred)

    def schedule(self) -> ScheduledStep:
        """The next step (module docstring); admits waiting requests as blocks allow. The
        step's requests count as scheduled (positions, pending tokens) from now on."""
        cfg, tile = self.config, self.config.prefill_tile
        decodes = tuple(s for s in self.running if s.prefilled and s.num_made < s.params.max_tokens)
        room = cfg.max_num_batched_tokens - decode_rows(len(decodes), tile)
        chunks: list[Chunk] = []

        def take(seq: Request) -> None:
            nonlocal room
            length = min(len(seq.prompt) - seq.num_computed, room)
            chunks.append(Chunk(seq, seq.num_computed, length))
            room -= ceil_div(length, tile) * tile

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
        if not decodes and not chunks:
            return ScheduledStep((), ())
        sources = []
        for seq in decodes:
            if seq.num_pending and seq.sample_step != self._serial - 1:
                raise RuntimeError(
                    f"request {seq.request_id!r}: its input token is in flight "
                    f"from a step before the previous one"
                )
            sources.append(seq.sample_step_index if seq.num_pending else -1)
        step = ScheduledStep(
            decodes,
            tuple(chunks),
            tuple(s.num_computed for s in decodes),
            tuple(0 if s.num_pending else s.output[-1] for s in decodes),
            tuple(sources),
            (),
        )
        sampled = step.sampled
        step = dataclasses.replace(step, counters=tuple(s.num_made for s in sampled))
        for seq in decodes:
            seq.num_computed += 1
        for chunk in chunks:
            chunk.seq.num_computed += chunk.length
        for i, seq in enumerate(sampled):
            seq.num_pending += 1
            seq.sample_step, seq.sample_step_index = self._serial, i
        for seq in step.seqs:
            seq.in_flight += 1
        self._serial += 1
        return step

    def update(self, step: ScheduledStep, tokens: Iterable[int]) -> list[Request]:
        """Take a scheduled step's ``tokens`` (one per ``step.sampled``, in order): append each
        to its request, finish those that hit a stop token or ``max_tokens``; a request that
        finished before (stopped, aborted) drops its token. Frees the blocks of finished
        requests no other unprocessed step holds. Returns the requests that got a token, in
        ``step.sampled`` order."""
        sampled = step.sampled
        tokens = list(tokens)
        if len(tokens) != len(sampled):
            raise ValueError(f"got {len(tokens)} tokens for {len(sampled)} sampled requests")
        for seq in step.seqs:
            seq.in_flight -= 1
        gained = []
        for seq, token in zip(sampled, tokens, strict=True):
            seq.num_pending -= 1
            if seq.finished:  # stopped or aborted after this step was scheduled
                continue
            seq.output.append(int(token))
            gained.append(seq)
            if int(token) in seq.stop_ids:
                self.finish(seq, "stop")
            elif len(seq.output) >= seq.params.max_tokens:
                self.finish(seq, "length")
        for seq in step.seqs:
            if seq.finished and not seq.in_flight:
                self._free(seq)
        return gained

    def drop(self, step: ScheduledStep) -> None:
        """Forget a scheduled step that will never run (it failed): its requests' bookkeeping as
        if :meth:`update` took it with no tokens. Its requests must be finished; their blocks
        are freed where no other unprocessed step holds them."""
        for seq in step.seqs:
            seq.in_flight -= 1
        for seq in step.sampled:
            seq.num_pending -= 1
        for seq in step.seqs:
            if seq.finished and not seq.in_flight:
                self._free(seq)

    def finish(self, seq: Request, reason: str) -> None:
        """Finish ``seq`` with ``reason`` (also a waiting one); its blocks are freed now, or
        once the unprocessed steps holding it are updated."""
        if seq.finished:
            return
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.in_flight:
            self.deferred.add(seq)
        else:
            self._free(seq)

    def _free(self, seq: Request) -> None:
        self.deferred.discard(seq)
        if seq.blocks:
            self.allocator.free(seq.blocks)
            seq.blocks = []
