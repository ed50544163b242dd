"""Continuous batching with chunked prefill (host side, pure Python), FCFS.

:meth:`Scheduler.schedule` makes a step: one decode token per running request that may make more,
then prompt chunks (partly prefilled requests first, then newly admitted ones) up to
``max_num_batched_tokens`` rows. KV blocks come from ``prefix_cache.KVCacheManager``: on
demand (the most recently admitted requests are preempted, to be recomputed, where the pool
runs dry) or reserved at admission, cached prefixes reused. :meth:`Scheduler.add` raises
``ValueError`` for a request that can never fit; :meth:`Scheduler.update` takes a step's
tokens later (async scheduling). The rules: docs/SERVING.md#servingschedulingscheduler.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.serving.buckets import decode_rows, trim_rows
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.scheduling.prefix_cache import KVCacheManager
from jax_tokenweave.serving.scheduling.request_state import Request

__all__ = ["Chunk", "Request", "ScheduledStep", "Scheduler"]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """``length`` tokens of ``seq`` to prefill from position ``start``; ``last``: it completes
    its prefill (the prompt, or what a preempted request recomputes; its last row is
    sampled)."""

    seq: Request
    start: int
    length: int

    @property
    def last(self) -> bool:
        return self.start + self.length == self.seq.num_prefill


@dataclasses.dataclass(frozen=True)
class ScheduledStep:
    """What one step computes: ``decodes`` (one token each) and prompt ``chunks``.

    Per decode: ``positions`` (its input token's), ``tokens`` (the input token where the host
    has it), ``sources`` (-1: ``tokens``; else its index among the previous step's sampled
    tokens, the input token still on the device). Per sampled request: ``counters`` (tokens it
    made before this one: the index into its random stream). ``admitted``: the requests it
    admits (each given a processor-state slot, ``Request.slot``)."""

    decodes: tuple[Request, ...]
    chunks: tuple[Chunk, ...]
    positions: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    sources: tuple[int, ...] = ()
    counters: tuple[int, ...] = ()
    admitted: tuple[Request, ...] = ()

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
        self.kv = KVCacheManager(config)
        self.allocator = self.kv.allocator
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.deferred: set[Request] = set()  # finished, blocks held by unprocessed steps
        # free rows of the processor state (a running request holds one); a finished or
        # preempted request's row may take a new request at once: the device writes it in
        # dispatch order, after the steps that held the old
        self._slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._serial = 0  # non-empty steps scheduled
        self.trimmed_steps = 0  # steps whose chunks were cut to fill the bucket below

    def check_fits(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        """``ValueError`` where a request of this size (``n`` samples) could never run: one
        sample's blocks must fit the cache (reserve: every sample's at once)."""
        cfg, needed = self.config, prompt_len + max_tokens - 1
        if prompt_len + max_tokens > cfg.max_model_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({cfg.max_model_len})"
            )
        samples = 1 if self.kv.on_demand else n
        blocks = self.allocator.blocks_for(needed) * samples
        if blocks > cfg.num_blocks:
            whose, alone = "the request", self.allocator.blocks_for(prompt_len) * samples
            if alone > cfg.num_blocks:  # whatever max_tokens
                whose, blocks = "its prompt alone", alone
            raise ValueError(
                f"{whose} needs {blocks} KV cache blocks of {cfg.block_size} "
                f"positions but the cache has only {cfg.num_blocks} (num_blocks)"
            )

    def add(self, seq: Request) -> None:
        """Queue ``seq`` (``ValueError`` where it could never fit, see :meth:`check_fits`)."""
        self.check_fits(len(seq.prompt), seq.max_tokens)
        self.kv.hash_known(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or blocks not yet freed."""
        return bool(self.waiting or self.running or self.deferred)

    def schedule(self) -> ScheduledStep:
        """The next step (module docstring): running requests in admission order (a decode
        or their next chunk, preempting the latest admitted where blocks run out), then, if
        none was preempted, waiting requests as blocks allow. The step's requests count as
        scheduled (positions, pending tokens) from now on."""
        cfg, tile, kv, bs = self.config, self.config.prefill_tile, self.kv, self.kv.block_size
        running = self.running
        # per running request: 1 decodes, 0 prefills, -1 neither (its last token is in flight)
        kinds = [
            (1 if s.num_made < s.max_tokens else -1) if s.num_computed >= s.num_prefill else 0
            for s in running
        ]
        room = cfg.max_num_batched_tokens - decode_rows(kinds.count(1), tile)
        decodes: list[Request] = []
        chunks: list[Chunk] = []
        admitted: list[Request] = []
        preempted, i = False, 0
        while i < len(running):
            seq, kind = running[i], kinds[i]
            if kind == 1:
                if seq.num_computed < len(seq.blocks) * bs:  # room in its last block
                    decodes.append(seq)
                    i += 1
                    continue
                length = 0
            elif kind == 0 and room >= tile:
                length = min(seq.num_prefill - seq.num_computed, room)
            else:
                i += 1
                continue
            while not kv.grow(seq, seq.num_computed + max(length, 1)):
                if length and kv.reachable(seq) > seq.num_computed:
                    length = kv.reachable(seq) - seq.num_computed  # a shorter chunk fits
                    continue
                victim = running[-1]  # the latest admitted (never one scheduled here)
                self._preempt(victim)
                kinds.pop()
                preempted = True
                if victim is seq:
                    break
            else:
                if length:
                    chunks.append(Chunk(seq, seq.num_computed, length))
                    room -= ceil_div(length, tile) * tile
                else:
                    decodes.append(seq)
                i += 1
        while (
            not preempted and self.waiting and room >= tile and len(self.running) < cfg.max_num_seqs
        ):
            head = self.waiting[0]
            if head.num_pending or head.in_flight:  # preempted; a step holding it is out
                break
            hits = kv.lookup(head)
            length = min(head.num_known - len(hits) * kv.block_size, room)
            if not kv.admit(head, hits, length):
                break
            self.running.append(self.waiting.popleft())
            head.slot = self._slots.pop()
            admitted.append(head)
            chunks.append(Chunk(head, head.num_computed, length))
            room -= ceil_div(length, tile) * tile
        if cfg.trim_to_bucket and chunks:
            chunks = self._trim(decode_rows(len(decodes), tile), chunks, admitted)
        return self._issue(tuple(decodes), tuple(chunks), tuple(admitted))

    def _trim(self, decode: int, chunks: list[Chunk], admitted: list[Request]) -> list[Chunk]:
        """``chunks`` cut from the end to fill the step's bucket below (``buckets.trim_rows``):
        the cut tokens come in a later step; a request admitted by this step whose whole chunk
        is cut goes back to the front of the queue, as if never admitted."""
        tile, cfg = self.config.prefill_tile, self.config
        rows = [ceil_div(c.length, tile) * tile for c in chunks]
        cut = trim_rows(decode, sum(rows), cfg.max_num_batched_tokens, tile)
        self.trimmed_steps += cut > 0
        while cut > 0:
            last, r = chunks[-1], rows[-1]
            if r > cut:
                chunks[-1] = Chunk(last.seq, last.start, r - cut)  # < last.length: whole tiles
                break
            chunks.pop()
            rows.pop()
            cut -= r
            if admitted and admitted[-1] is last.seq:
                self._unadmit(admitted.pop())
        return chunks

    def _unadmit(self, seq: Request) -> None:
        """Undo :meth:`schedule`'s admission of ``seq`` (nothing issued holds it yet)."""
        self.running.remove(seq)
        self._release_slot(seq)
        self.kv.unadmit(seq)
        self.waiting.appendleft(seq)

    def _issue(
        self,
        decodes: tuple[Request, ...],
        chunks: tuple[Chunk, ...],
        admitted: tuple[Request, ...] = (),
    ) -> ScheduledStep:
        """The step of these decodes and chunks (``admitted``: the requests it admits); its
        requests advance (positions, pending tokens, steps holding them)."""
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
            chunks,
            tuple(s.num_computed for s in decodes),
            tuple(0 if s.num_pending else s.output[-1] for s in decodes),
            tuple(sources),
            (),
            admitted,
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

    def _preempt(self, seq: Request) -> None:
        """Take ``seq``'s blocks back and queue it first, to be recomputed from its prompt and
        the tokens it made (those in flight arrive by :meth:`update` meanwhile). The blocks
        go to other requests at once: a later step runs on the cache the steps before it
        returned, so their writes of these blocks come first."""
        if self.running[-1] is seq:
            self.running.pop()
        else:
            self.running.remove(seq)
        self.kv.free(seq)
        self._release_slot(seq)
        seq.preemptions += 1
        self.kv.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, step: ScheduledStep, tokens: Iterable[int]) -> list[Request]:
        """Take a scheduled step's ``tokens`` (one per ``step.sampled``, in order): append each
        to its request, finish those that hit a stop token or ``max_tokens``; a request that
        finished before (stopped, aborted) drops its token. The K/V the step wrote is cached
        (prefix caching); the blocks of finished requests no other unprocessed step holds are
        freed. Returns the requests that got a token, in ``step.sampled`` order."""
        sampled = step.sampled
        tokens = list(tokens)
        if len(tokens) != len(sampled):
            raise ValueError(f"got {len(tokens)} tokens for {len(sampled)} sampled requests")
        for seq in step.seqs:
            seq.in_flight -= 1
        gained, ends, kv = [], [], self.kv
        caching, bs = kv.caching, kv.block_size
        for seq, token in zip(sampled, tokens, strict=True):
            seq.num_pending -= 1
            if seq.finished:  # stopped or aborted after this step was scheduled
                continue
            seq.output.append(int(token))
            if caching and not (len(seq.prompt) + len(seq.output)) % bs:  # a full block known
                kv.hash_known(seq)
            gained.append(seq)
            if int(token) in seq.stop_ids and len(seq.output) >= seq.params.min_tokens:
                ends.append((seq, "stop"))
            elif len(seq.output) >= seq.max_tokens:
                ends.append((seq, "length"))
        if caching:  # the full blocks this step wrote are cached
            for seq, position in zip(step.decodes, step.positions, strict=True):
                if not (position + 1) % bs:
                    kv.commit(seq, position + 1)
            for chunk in step.chunks:
                kv.commit(chunk.seq, chunk.start + chunk.length)
        for seq, reason in ends:
            self.finish(seq, reason)
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
        self._release_slot(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.in_flight:
            self.deferred.add(seq)
        else:
            self._free(seq)

    def _release_slot(self, seq: Request) -> None:
        if seq.slot >= 0:
            self._slots.append(seq.slot)
            seq.slot = -1

    def _free(self, seq: Request) -> None:
        self.deferred.discard(seq)
        self.kv.free(seq)
