"""The KV cache's host side (no JAX compute): the reference-counted allocator with cached blocks
and LRU eviction, chained block hashes, blocks on demand (growth, preemption of the latest
admitted, recomputation from prompt + tokens made) and the reserve policy, prefix-cache hits
(capped one token short, only once a taken step wrote them) and their counts."""

from __future__ import annotations

import dataclasses

import pytest

from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.sampling_params import SamplingParams
from jax_tokenweave.serving.scheduling.blocks import BlockAllocator, OutOfBlocksError
from jax_tokenweave.serving.scheduling.prefix_cache import block_hashes
from jax_tokenweave.serving.scheduling.scheduler import Request, Scheduler

CFG = EngineConfig(
    max_num_batched_tokens=32,
    max_num_seqs=4,
    prefill_tile=8,
    block_size=4,
    num_blocks=16,
    max_model_len=40,
    key_chunk=8,
    split_threshold=16,
)


def seq(name: str, prompt, max_tokens: int = 8) -> Request:
    prompt = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    return Request(
        name,
        prompt,
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        seed=0,
        stop_ids=frozenset({999}),
    )


def run_step(s: Scheduler, token: int = 7):
    """Schedule a step and take it at once (every sampled request gets ``token``)."""
    step = s.schedule()
    s.update(step, [token] * len(step.sampled))
    return step


def test_allocator_counts_users_and_keeps_cached_blocks():
    a = BlockAllocator(4, 2)
    x = a.allocate(2)
    assert x == [0, 1] and a.num_free == 2
    assert a.cache(x[0], b"h0") and not a.cache(x[1], b"h0")  # one block per hash
    a.touch([x[0]])  # a second request shares block 0
    a.free(x)
    assert a.num_free == 3 and a.lookup(b"h0") == 0 and a.is_used(0)
    a.free([0])
    assert a.num_free == 4 and a.lookup(b"h0") == 0 and a.num_cached == 1  # cached, no user
    with pytest.raises(ValueError, match="double free"):
        a.free([0])
    a.touch([0])  # a hit takes it out of the free blocks
    assert a.num_free == 3 and a.is_used(0)
    with pytest.raises(ValueError, match="neither in use nor cached"):
        a.touch([3])
    with pytest.raises(OutOfBlocksError, match="asked for 4, 3 of 4 free"):
        a.allocate(4)
    a.free([0])


def test_allocator_evicts_uncached_first_then_least_recently_freed():
    a = BlockAllocator(4, 2)
    blocks = a.allocate(4)
    for b, h in zip(blocks[:3], (b"a", b"b", b"c"), strict=True):
        a.cache(b, h)
    a.free([2, 0, 3, 1])  # freed in this order: 2, 0 cached; 3 uncached; 1 cached
    assert a.allocate(1) == [3] and a.evictions == 0  # the uncached one first
    assert a.allocate(2) == [2, 0] and a.evictions == 2  # then LRU: 2 before 0
    assert a.lookup(b"c") is None and a.lookup(b"a") is None and a.lookup(b"b") == 1
    assert not a.reset_cache()  # blocks in use: nothing dropped
    a.free([3, 2, 0])
    assert a.reset_cache() and a.num_cached == 0 and a.num_free == 4


def test_block_hashes_are_chained():
    h = block_hashes(range(10), 4)
    assert len(h) == 2 and len(set(h)) == 2  # the partial third block has none
    assert block_hashes([0, 1, 2, 3, 4, 5, 6, 7, 99], 4) == h
    other = block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert other[1] != h[1]  # same tokens, other prefix: another hash
    assert block_hashes(range(4, 8), 4, parent=h[0]) == h[1:]


def test_blocks_grow_on_demand():
    s = Scheduler(CFG)
    a = seq("a", 6, max_tokens=12)
    s.add(a)
    run_step(s)  # the prompt: 2 blocks, not the 5 of prompt + max_tokens
    assert len(a.blocks) == 2 and s.allocator.num_free == 14
    sizes = []
    for _ in range(6):
        run_step(s)  # each decode writes position num_computed - 1
        sizes.append(len(a.blocks))
    assert sizes == [2, 2, 3, 3, 3, 3]  # a third block once position 8 is written
    reserve = Scheduler(dataclasses.replace(CFG, kv_allocation="reserve"))
    b = seq("b", 6, max_tokens=12)
    reserve.add(b)
    run_step(reserve)
    assert len(b.blocks) == 5  # 6 + 12 - 1 positions


def test_the_latest_admitted_is_preempted_and_recomputed():
    s = Scheduler(dataclasses.replace(CFG, num_blocks=6))  # 24 positions
    a, b = seq("a", 8, max_tokens=16), seq("b", range(20, 28), max_tokens=16)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefill: 2 blocks each
    for _ in range(4):
        run_step(s)  # positions 8-11: a third block each
    assert (len(a.blocks), len(b.blocks)) == (3, 3) and s.allocator.num_free == 0
    step = run_step(s)  # a needs a 4th block: b (admitted last) gives its blocks back
    assert [q.request_id for q in step.decodes] == ["a"] and not step.chunks
    assert b.blocks == [] and b.num_computed == 0 and b.preemptions == 1
    assert list(s.waiting) == [b] and s.running == [a] and s.kv.stats.preemptions == 1
    assert len(b.output) == 5  # its tokens are kept, not made again
    recomputed = []
    while s.has_unfinished():
        step = s.schedule()
        recomputed += [
            (c.start, c.length, len(b.output), step.counters[step.sampled.index(b)])
            for c in step.chunks
            if c.seq is b and c.last
        ]
        s.update(step, [7] * len(step.sampled))
    # back once a finished: its prompt and the 5 tokens it made are prefilled (its cached
    # blocks were evicted meanwhile), its 6th token drawn from its 6th random stream
    assert recomputed == [(0, 13, 5, 5)]
    assert b.num_prefill == 13 and len(b.output) == 16 and s.allocator.num_free == 6
    assert s.kv.stats.prefix_cache_queries == 16  # recomputation is not counted


def test_a_request_preempts_itself_where_it_is_the_latest():
    cfg = dataclasses.replace(CFG, num_blocks=5, enable_prefix_caching=False)
    s = Scheduler(cfg)
    a, b = seq("a", 12, max_tokens=8), seq("b", 4, max_tokens=8)
    s.add(a)
    s.add(b)
    run_step(s)  # a: 3 blocks, b: 1
    run_step(s)  # a takes the last free block (position 12); b has none for position 4
    assert s.running == [a] and list(s.waiting) == [b] and b.preemptions == 1
    while s.has_unfinished():
        run_step(s)  # b waits for a's blocks, then runs
    assert a.output == [7] * 8 and b.output == [7] * 8 and s.allocator.num_free == 5


def test_a_chunk_shrinks_to_the_free_blocks_before_anyone_is_preempted():
    cfg = dataclasses.replace(CFG, num_blocks=9, enable_prefix_caching=False)
    s = Scheduler(cfg)
    a, big = seq("a", 4, max_tokens=8), seq("big", 30, max_tokens=4)
    s.add(a)
    s.add(big)
    run_step(s)  # a's prompt (1 block), big's first 24 tokens (6 blocks)
    step = s.schedule()  # a decodes (its 2nd block); big's next chunk: the block left
    assert [(c.start, c.length) for c in step.chunks] == [(24, 4)]
    assert s.kv.stats.preemptions == 0
    s.update(step, [7])
    s.schedule()  # big's last 2 tokens need one more block: big, the latest, steps back
    assert s.kv.stats.preemptions == 1 and list(s.waiting) == [big] and s.running == [a]


def test_prefix_hits_are_capped_and_only_once_written():
    s = Scheduler(CFG)
    a = seq("a", 12, max_tokens=2)
    s.add(a)
    step_a = s.schedule()
    b = seq("b", [*range(1, 11), 50, 51])  # a's first 10 tokens, then others
    s.add(b)
    s.schedule()  # b is admitted before a's step is taken: nothing cached yet
    assert b.num_computed == 12 and b.num_cached_blocks == 0
    s.update(step_a, [7])
    c = seq("c", [*range(1, 11), 60])
    d = seq("d", 12)  # a's whole prompt: one token is computed all the same
    s.add(c)
    s.add(d)
    step = s.schedule()
    chunks = {ch.seq.request_id: ch for ch in step.chunks}
    assert chunks["c"].start == 8 and c.blocks[:2] == a.blocks[:2]  # two full blocks shared
    assert chunks["d"].start == 8 and chunks["d"].length == 4  # (12 - 1) // 4 blocks
    stats = s.kv.stats
    assert stats.prefix_cache_queries == 12 + 12 + 11 + 12
    assert stats.prefix_cache_hits == 8 + 8


def test_eviction_drops_the_least_recently_freed_blocks_last_block_first():
    cfg = dataclasses.replace(CFG, num_blocks=8)
    s = Scheduler(cfg)
    done = {}
    for name, first in (("x", 100), ("y", 200)):
        done[name] = r = seq(name, range(first, first + 8), max_tokens=1)
        s.add(r)
        run_step(s)
        assert r.finished
    assert s.allocator.num_cached == 4 and s.allocator.num_free == 8
    z = seq("z", range(300, 320), max_tokens=1)  # 5 blocks: the 4 uncached ones, then LRU
    s.add(z)
    run_step(s)
    x, y = done["x"].block_hashes, done["y"].block_hashes
    assert s.allocator.evictions == 1 and s.allocator.lookup(x[1]) is None  # x's last block
    assert None not in [s.allocator.lookup(h) for h in (x[0], *y)]
    y2 = seq("y2", range(200, 209), 1)
    s.add(y2)
    (chunk,) = s.schedule().chunks
    assert chunk.start == 8 and y2.blocks[:2] == [s.allocator.lookup(h) for h in y]
    assert s.allocator.evictions == 2 and s.allocator.lookup(x[0]) is None  # y2's new block
    x2 = seq("x2", range(100, 109), 1)
    s.add(x2)
    (chunk,) = s.schedule().chunks
    assert chunk.start == 0 and s.kv.stats.prefix_cache_hits == 8
