"""Host side of the serving engine (no JAX compute): the block allocator, the continuous-batching
scheduler (budget, chunking, admission, freeing), the packed step layout and buckets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.models.configs import get_config
from jax_tokenweave.serving.buckets import decode_only_rows, decode_rows, next_pow2, step_rows
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.runner.batch import make_layout, pack
from jax_tokenweave.serving.sampling_params import SamplingParams
from jax_tokenweave.serving.scheduling.blocks import BlockAllocator, OutOfBlocksError
from jax_tokenweave.serving.scheduling.scheduler import Chunk, Request, ScheduledStep, Scheduler

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
MODEL = get_config("tiny")


def seq(name: str, prompt_len: int, max_tokens: int = 4, **params) -> Request:
    return Request(
        name,
        list(range(1, prompt_len + 1)),
        SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
        seed=0,
        stop_ids=frozenset({99}),
    )


def test_allocator():
    a = BlockAllocator(4, 16)
    assert a.blocks_for(0) == 0 and a.blocks_for(16) == 1 and a.blocks_for(17) == 2
    got = a.allocate(3)
    assert got == [0, 1, 2] and a.num_free == 1
    with pytest.raises(OutOfBlocksError, match=r"asked for 2, 1 of 4 free"):
        a.allocate(2)
    a.free(got[:2])
    assert a.num_free == 3 and sorted(a.allocate(3)) == [0, 1, 3]
    with pytest.raises(ValueError, match="not allocated"):
        a.free([0, 0])


def test_buckets():
    assert [next_pow2(n) for n in (0, 1, 3, 4, 5)] == [1, 1, 4, 4, 8]
    assert [decode_rows(n, 8) for n in (0, 1, 8, 9)] == [0, 8, 8, 16]
    assert [step_rows(n, 48, 8) for n in (1, 9, 17, 40, 48)] == [8, 16, 32, 48, 48]
    # decodes alone: powers of two from 8, never above the mixed steps' decode segment
    assert [decode_only_rows(n, 64) for n in (1, 8, 9, 33, 64, 65)] == [8, 8, 16, 64, 64, 128]
    assert [decode_only_rows(n, 4) for n in (1, 5)] == [4, 8]


def test_a_decode_only_step_is_not_padded_to_a_tile():
    cfg = dataclasses.replace(
        CFG, prefill_tile=16, block_size=8, key_chunk=16, max_num_batched_tokens=64
    )
    s = Scheduler(cfg)
    for name in "abc":
        s.add(seq(name, 3))
    step = s.schedule()  # three prompt chunks: one 16-row tile each
    layout, _ = pack(step, cfg, MODEL, 1)
    assert (layout.decode_rows, layout.rows) == (0, 64)
    s.update(step, [7, 8, 9])
    step = s.schedule()  # three decodes, nothing else: 8 rows, not a 16-row tile
    layout, arrays = pack(step, cfg, MODEL, 1)
    assert len(step.decodes) == 3 and not step.chunks
    assert (layout.decode_rows, layout.rows, arrays.tokens.shape) == (8, 8, (8,))
    assert arrays.tokens[:3].tolist() == [7, 8, 9]


def test_decodes_first_then_chunks_within_budget():
    s = Scheduler(CFG)
    for name, n in (("a", 5), ("b", 30), ("c", 3)):
        s.add(seq(name, n))
    step = s.schedule()
    # a: 5 tokens (one tile), b: 24 of 30 (fills the 32-row budget), c waits for room.
    assert [(c.seq.request_id, c.start, c.length) for c in step.chunks] == [
        ("a", 0, 5),
        ("b", 0, 24),
    ]
    assert not step.decodes and [q.request_id for q in s.waiting] == ["c"]
    assert [q.request_id for q in step.sampled] == ["a"]
    s.update(step, [7])
    step = s.schedule()
    # a decodes (8 rows), b's last 6 prompt tokens (8 rows), c's whole prompt (8 rows).
    assert [q.request_id for q in step.decodes] == ["a"]
    assert [(c.seq.request_id, c.start, c.length) for c in step.chunks] == [
        ("b", 24, 6),
        ("c", 0, 3),
    ]
    assert [q.request_id for q in step.sampled] == ["a", "b", "c"]


def test_reserved_admission_waits_for_blocks_and_frees_at_finish():
    cfg = dataclasses.replace(CFG, num_blocks=6, kv_allocation="reserve")  # 24 positions
    s = Scheduler(cfg)
    s.add(seq("a", 12, max_tokens=5))  # needs 16 positions: 4 blocks
    s.add(seq("b", 4, max_tokens=5))  # needs 8: 2 blocks, so
    s.add(seq("c", 4, max_tokens=5))  # c must wait for a block
    step = s.schedule()
    assert [c.seq.request_id for c in step.chunks] == ["a", "b"]
    assert s.allocator.num_free == 0 and [q.request_id for q in s.waiting] == ["c"]
    s.update(step, [99, 5])  # a stops (token 99)
    a = step.chunks[0].seq
    assert a.finish_reason == "stop" and a.blocks == [] and s.allocator.num_free == 4
    step = s.schedule()
    assert [q.request_id for q in step.decodes] == ["b"]
    assert [c.seq.request_id for c in step.chunks] == ["c"]


def test_requests_that_can_never_fit_are_refused():
    s = Scheduler(CFG)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        s.add(seq("a", 38, max_tokens=4))
    with pytest.raises(ValueError, match="KV cache blocks"):
        Scheduler(dataclasses.replace(CFG, num_blocks=2)).add(seq("a", 8, max_tokens=4))
    assert not s.has_unfinished()


def test_length_finish_and_max_num_seqs():
    s = Scheduler(dataclasses.replace(CFG, max_num_seqs=1, max_num_batched_tokens=16))
    s.add(seq("a", 3, max_tokens=2))
    s.add(seq("b", 3, max_tokens=2))
    step = s.schedule()
    assert [c.seq.request_id for c in step.chunks] == ["a"]  # one running at most
    s.update(step, [1])
    step = s.schedule()
    assert [q.request_id for q in step.decodes] == ["a"] and not step.chunks
    s.update(step, [2])
    assert step.decodes[0].finish_reason == "length"
    assert [c.seq.request_id for c in s.schedule().chunks] == ["b"]


def test_pack_layout_and_arrays():
    s = Scheduler(dataclasses.replace(CFG, enable_prefix_caching=False))  # b: a's prefix
    s.add(seq("a", 5))
    s.update(s.schedule(), [42])
    s.add(seq("b", 30))
    step = s.schedule()  # a decodes; b's first 24 tokens
    layout, arrays = pack(step, CFG, MODEL, tp=2)
    assert (layout.decode_rows, layout.rows, layout.groups) == (8, 32, 8 + 3)
    assert layout.plan.is_split and layout.plan.halves[1].start % CFG.prefill_tile == 0
    a, b = step.decodes[0], step.chunks[0].seq
    assert arrays.tokens[0] == 42 and arrays.positions[0] == 5
    assert arrays.slots[0] == a.blocks[5 // 4] * 4 + 5 % 4
    assert (arrays.slots[1:8] == CFG.num_blocks * CFG.block_size).all()  # padding
    np.testing.assert_array_equal(arrays.tokens[8:32], b.prompt[:24])
    np.testing.assert_array_equal(arrays.positions[8:32], np.arange(24))
    np.testing.assert_array_equal(arrays.tables[0, : len(a.blocks)], a.blocks)
    for group in (8, 9, 10):
        np.testing.assert_array_equal(arrays.tables[group, : len(b.blocks)], b.blocks)
    assert arrays.sample_rows[0] == 0 and layout.samples == 4


def test_layout_split_moves_to_a_tile_boundary():
    cfg = dataclasses.replace(CFG, prefill_tile=16, max_num_batched_tokens=96, split_threshold=64)
    layout = make_layout(16, 96, cfg, MODEL, 2)
    assert layout.plan.is_split and layout.plan.halves[1].start % 16 == 0
    assert not make_layout(0, 32, cfg, MODEL, 2).plan.is_split  # below threshold
    base = dataclasses.replace(cfg, schedule="baseline")
    assert not make_layout(16, 96, base, MODEL, 2).plan.is_split


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prefill_tile": 12}, "power of two"),
        ({"max_num_batched_tokens": 36}, "multiple of prefill_tile"),
        ({"max_num_seqs": 32}, "no room"),
        ({"key_chunk": 6}, "multiple of block_size"),
        ({"schedule": "nocomm"}, "schedule"),
        ({"collective": "nccl"}, "collective"),
        ({"num_blocks": 0}, "num_blocks must be >= 1"),
        ({"max_num_seqs": 2.5}, "max_num_seqs must be an integer"),
        ({"tuning": 3}, "tuning"),
        ({"async_scheduling": 1}, "async_scheduling must be a bool"),
    ],
)
def test_engine_config_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CFG, **kwargs)


def reference_pack(step, cfg, model, tp):
    """``batch.pack`` written plainly (one token at a time), to check the vectorized one."""
    tile, bs = cfg.prefill_tile, cfg.block_size
    if step.decodes and not step.chunks:  # decodes only: no tile alignment, fewer rows
        decode = rows = min(
            max(next_pow2(len(step.decodes)), 8), decode_rows(len(step.decodes), tile)
        )
    else:
        decode = decode_rows(len(step.decodes), tile)
        used = decode + sum(ceil_div(c.length, tile) * tile for c in step.chunks)
        rows = step_rows(used, cfg.max_num_batched_tokens, tile)
    layout = make_layout(decode, rows, cfg, model, tp)
    r, s = layout.rows, layout.samples
    tokens, positions = np.zeros(r, np.int32), np.zeros(r, np.int32)
    slots = np.full(r, cfg.num_blocks * bs, np.int32)
    tables = np.zeros((layout.groups, cfg.table_width), np.int32)
    sample_rows = np.zeros(s, np.int32)

    def place(row, blocks, token, position):
        tokens[row], positions[row] = token, position
        slots[row] = blocks[position // bs] * bs + position % bs

    source = np.full(r, -1, np.int32)
    for i, q in enumerate(step.decodes):
        place(i, q.blocks, step.tokens[i], step.positions[i])
        source[i] = step.sources[i]
        tables[i, : len(q.blocks)] = q.blocks
        sample_rows[i] = i
    n_sampled, row = len(step.decodes), decode
    for chunk in step.chunks:
        q = chunk.seq
        for j in range(chunk.length):
            place(row + j, q.blocks, q.prompt[chunk.start + j], chunk.start + j)
        tiles = ceil_div(chunk.length, tile)
        group = decode + (row - decode) // tile
        tables[group : group + tiles, : len(q.blocks)] = q.blocks
        if chunk.last:
            sample_rows[n_sampled] = row + chunk.length - 1
            n_sampled += 1
        row += tiles * tile
    fields = [
        np.zeros(s, np.float32),
        np.ones(s, np.float32),
        np.zeros(s, np.int32),
        np.zeros(s, np.uint32),
        np.zeros(s, np.int32),
    ]
    for i, q in enumerate(step.sampled):
        p = q.params
        for f, v in zip(
            fields,
            (p.temperature, p.top_p, max(p.top_k, 0), q.seed % (1 << 32), step.counters[i]),
            strict=True,
        ):
            f[i] = v
    want = np.asarray(any(q.params.logprobs is not None for q in step.sampled))
    return layout, (tokens, source, positions, slots, tables, sample_rows, *fields, want)


def random_step(rng, cfg):
    """A random step within ``cfg``'s budget: decodes (input token from the host or from the
    previous step) and prompt chunks (first, middle, last) of requests whose blocks are random
    ids in random order."""
    tile, bs = cfg.prefill_tile, cfg.block_size
    free = list(rng.permutation(cfg.num_blocks))
    n_dec = int(rng.integers(0, cfg.max_num_seqs + 1))
    room = cfg.max_num_batched_tokens - decode_rows(n_dec, tile)
    decodes, chunks = [], []

    def make(prompt_len, computed, made):
        max_tokens = made + int(rng.integers(1, 4))
        q = Request(
            f"r{len(decodes) + len(chunks)}",
            rng.integers(0, 1000, prompt_len).tolist(),
            SamplingParams(
                max_tokens=max_tokens,
                temperature=float(rng.random()),
                top_p=float(rng.uniform(0.1, 1)),
                top_k=int(rng.integers(-1, 5)),
                logprobs=None if rng.random() < 0.9 else 1,
            ),
            seed=int(rng.integers(1 << 40)),
            stop_ids=frozenset(),
        )
        q.num_computed, q.output = computed, rng.integers(0, 1000, made).tolist()
        need = ceil_div(prompt_len + max_tokens - 1, bs)
        q.blocks = [int(free.pop()) for _ in range(need)]
        return q

    for _ in range(n_dec):
        prompt_len = int(rng.integers(1, cfg.max_model_len // 2))
        made = int(rng.integers(1, cfg.max_model_len - prompt_len - 3))
        decodes.append(make(prompt_len, prompt_len + made - 1, made))
    while room >= tile and len(decodes) + len(chunks) < cfg.max_num_seqs and rng.random() < 0.8:
        prompt_len = int(rng.integers(1, cfg.max_model_len - 4))
        start = int(rng.integers(0, prompt_len))
        length = min(int(rng.integers(1, prompt_len - start + 1)), room)
        chunks.append(Chunk(make(prompt_len, start, 0), start, length))
        room -= ceil_div(length, tile) * tile
    step = ScheduledStep(tuple(decodes), tuple(chunks))
    prev = int(rng.integers(1, cfg.max_num_seqs + 1))
    return dataclasses.replace(
        step,
        positions=tuple(q.num_computed for q in decodes),
        tokens=tuple(q.output[-1] for q in decodes),
        sources=tuple(int(rng.integers(-1, prev)) for _ in decodes),
        counters=tuple(len(q.output) for q in step.sampled),
    )


@pytest.mark.parametrize("tile", [4, 8])
def test_pack_equals_the_plain_reference(rng, tile):
    cfg = EngineConfig(
        max_num_batched_tokens=64,
        max_num_seqs=6,
        prefill_tile=tile,
        block_size=4,
        num_blocks=256,
        max_model_len=40,
        key_chunk=8,
        split_threshold=16,
    )
    for _ in range(200):
        step = random_step(rng, cfg)
        layout, arrays = pack(step, cfg, MODEL, tp=2)
        want_layout, want = reference_pack(step, cfg, MODEL, tp=2)
        assert layout == want_layout
        got = (
            arrays.tokens,
            arrays.token_source,
            arrays.positions,
            arrays.slots,
            arrays.tables,
            arrays.sample_rows,
            arrays.temperature,
            arrays.top_p,
            arrays.top_k,
            arrays.seeds,
            arrays.counters,
            arrays.want_logprobs,
        )
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)
