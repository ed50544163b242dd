"""Host side of the serving engine (no JAX compute): the block allocator, the continuous-batching
scheduler (budget, chunking, admission, freeing), the packed step layout and buckets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jax_tokenweave.models.configs import get_config
from jax_tokenweave.serving.batch import make_layout, pack
from jax_tokenweave.serving.blocks import BlockAllocator, OutOfBlocksError
from jax_tokenweave.serving.buckets import decode_rows, next_pow2, step_rows
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.sampling_params import SamplingParams
from jax_tokenweave.serving.scheduler import Scheduler, Sequence

CFG = EngineConfig(max_num_batched_tokens=32, max_num_seqs=4, prefill_tile=8, block_size=4,
                   num_blocks=16, max_model_len=40, key_chunk=8, split_threshold=16)
MODEL = get_config("tiny")


def seq(name: str, prompt_len: int, max_tokens: int = 4, **params) -> Sequence:
    return Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens,
                                                                         **params),
                    seed=0, stop_ids=frozenset({99}))


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


def test_decodes_first_then_chunks_within_budget():
    s = Scheduler(CFG)
    for name, n in (("a", 5), ("b", 30), ("c", 3)):
        s.add(seq(name, n))
    step = s.schedule()
    # a: 5 tokens (one tile), b: 24 of 30 (fills the 32-row budget), c waits for room.
    assert [(c.seq.request_id, c.start, c.length) for c in step.chunks] == \
        [("a", 0, 5), ("b", 0, 24)]
    assert not step.decodes and [q.request_id for q in s.waiting] == ["c"]
    assert [q.request_id for q in step.sampled] == ["a"]
    s.update(step, [7])
    step = s.schedule()
    # a decodes (8 rows), b's last 6 prompt tokens (8 rows), c's whole prompt (8 rows).
    assert [q.request_id for q in step.decodes] == ["a"]
    assert [(c.seq.request_id, c.start, c.length) for c in step.chunks] == \
        [("b", 24, 6), ("c", 0, 3)]
    assert [q.request_id for q in step.sampled] == ["a", "b", "c"]


def test_admission_waits_for_blocks_and_frees_at_finish():
    cfg = dataclasses.replace(CFG, num_blocks=6)          # 24 positions
    s = Scheduler(cfg)
    s.add(seq("a", 12, max_tokens=5))                     # needs 16 positions: 4 blocks
    s.add(seq("b", 4, max_tokens=5))                      # needs 8: 2 blocks, so
    s.add(seq("c", 4, max_tokens=5))                      # c must wait for a block
    step = s.schedule()
    assert [c.seq.request_id for c in step.chunks] == ["a", "b"]
    assert s.allocator.num_free == 0 and [q.request_id for q in s.waiting] == ["c"]
    s.update(step, [99, 5])                               # a stops (token 99)
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
    assert [c.seq.request_id for c in step.chunks] == ["a"]   # one running at most
    s.update(step, [1])
    step = s.schedule()
    assert [q.request_id for q in step.decodes] == ["a"] and not step.chunks
    s.update(step, [2])
    assert step.decodes[0].finish_reason == "length"
    assert [c.seq.request_id for c in s.schedule().chunks] == ["b"]


def test_pack_layout_and_arrays():
    s = Scheduler(CFG)
    s.add(seq("a", 5))
    s.update(s.schedule(), [42])
    s.add(seq("b", 30))
    step = s.schedule()                    # a decodes; b's first 24 tokens
    layout, arrays = pack(step, CFG, MODEL, tp=2)
    assert (layout.decode_rows, layout.rows, layout.groups) == (8, 32, 8 + 3)
    assert layout.plan.split and layout.plan.halves[1].start % CFG.prefill_tile == 0
    a, b = step.decodes[0], step.chunks[0].seq
    assert arrays.tokens[0] == 42 and arrays.positions[0] == 5
    assert arrays.slots[0] == a.blocks[5 // 4] * 4 + 5 % 4
    assert (arrays.slots[1:8] == CFG.num_blocks * CFG.block_size).all()       # padding
    np.testing.assert_array_equal(arrays.tokens[8:32], b.prompt[:24])
    np.testing.assert_array_equal(arrays.positions[8:32], np.arange(24))
    np.testing.assert_array_equal(arrays.tables[0, :len(a.blocks)], a.blocks)
    for group in (8, 9, 10):
        np.testing.assert_array_equal(arrays.tables[group, :len(b.blocks)], b.blocks)
    assert arrays.sample_rows[0] == 0 and layout.samples == 4


def test_layout_split_moves_to_a_tile_boundary():
    cfg = dataclasses.replace(CFG, prefill_tile=16, max_num_batched_tokens=96,
                              split_threshold=64)
    layout = make_layout(16, 96, cfg, MODEL, 2)
    assert layout.plan.split and layout.plan.halves[1].start % 16 == 0
    assert not make_layout(0, 32, cfg, MODEL, 2).plan.split              # below threshold
    base = dataclasses.replace(cfg, schedule="baseline")
    assert not make_layout(16, 96, base, MODEL, 2).plan.split


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"prefill_tile": 12}, "power of two"),
    ({"max_num_batched_tokens": 36}, "multiple of prefill_tile"),
    ({"max_num_seqs": 32}, "no room"),
    ({"key_chunk": 6}, "multiple of block_size"),
    ({"schedule": "nocomm"}, "schedule"),
    ({"comm": "nccl"}, "comm"),
    ({"num_blocks": 0}, "num_blocks must be >= 1"),
    ({"max_num_seqs": 2.5}, "max_num_seqs must be an integer"),
    ({"tuning": 3}, "tuning"),
])
def test_engine_config_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CFG, **kwargs)
