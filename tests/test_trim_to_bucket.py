"""Steps cut to the bucket below rather than padded up (``buckets.trim_rows``,
``EngineConfig.trim_to_bucket``): the rule, the scheduler's cut (a chunk shortened, an
admission undone), and greedy outputs still the float64 reference's with steps cut."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx
from test_scheduler import CFG, MODEL, seq
from test_serving import prompts, reference_greedy, run_with_arrivals
from testutil import SMALL_ENGINE

from jax_tokenweave.models.configs import get_config
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.nn.params import logical_weights
from jax_tokenweave.serving import LLMEngine, SamplingParams, buckets
from jax_tokenweave.serving.runner.batch import pack
from jax_tokenweave.serving.scheduling.scheduler import Scheduler


@pytest.fixture
def small_padding(monkeypatch):
    """Cut steps that would pad 8 rows or more (the tiny tests' steps are 8-32 rows)."""
    monkeypatch.setattr(buckets, "TRIM_MIN_PADDING", 8)


def test_trim_rows_rule():
    # 128 decode rows + 512 of chunks would pad 384 rows up to 1024: cut 128 to fill 512.
    assert buckets.trim_rows(128, 512, 8192, 128) == 128
    assert buckets.trim_rows(0, 5120, 8192, 128) == 1024  # 3072 of padding: fill 4096
    assert buckets.trim_rows(512, 512, 8192, 128) == 0  # fills its bucket
    assert buckets.trim_rows(128, 256, 8192, 128) == 0  # 128 rows of padding: kept
    assert buckets.trim_rows(512, 128, 8192, 128) == 0  # the bucket below has no chunk
    assert buckets.trim_rows(0, 6144, 6144, 128) == 0  # the budget is its own bucket


def test_a_chunk_is_shortened_to_fill_the_bucket_below(small_padding):
    s = Scheduler(CFG)  # 32-row budget, tiles of 8
    s.add(seq("a", 3))
    s.update(s.schedule(), [7])
    s.add(seq("b", 9))  # 2 tiles: 8 decode rows + 16 = 24 rows, padded to 32 uncut
    step = s.schedule()
    assert [(c.seq.request_id, c.start, c.length) for c in step.chunks] == [("b", 0, 8)]
    assert pack(step, CFG, MODEL, 1)[0].rows == 16 and s.trimmed_steps == 1
    s.update(step, [8])
    step = s.schedule()  # b's last token: 8 + 8 rows, its bucket
    assert [(c.seq.request_id, c.start, c.length) for c in step.chunks] == [("b", 8, 1)]
    assert s.trimmed_steps == 1


def test_a_whole_cut_admission_is_undone(small_padding):
    s = Scheduler(CFG)
    s.add(seq("a", 3))
    s.update(s.schedule(), [7])
    queries = s.kv.stats.prefix_cache_queries
    free, slots = s.allocator.num_free, len(s._slots)
    s.add(seq("b", 5))
    s.add(seq("c", 5))  # 8 + 8 + 8 = 24 rows: c's whole tile is cut
    step = s.schedule()
    assert [c.seq.request_id for c in step.chunks] == ["b"]
    assert [q.request_id for q in s.running] == ["a", "b"]
    assert [q.request_id for q in s.waiting] == ["c"] and step.admitted[0].request_id == "b"
    c = s.waiting[0]
    assert c.blocks == [] and c.slot == -1 and c.num_computed == 0
    assert s.allocator.num_free == free - 2 and len(s._slots) == slots - 1  # b's only
    assert s.kv.stats.prefix_cache_queries == queries + 5
    s.update(step, [8, 9])  # a's decode, b's first token
    step = s.schedule()  # a and b decode (8 rows), c's prompt (8 rows): 16, its bucket
    assert [c.seq.request_id for c in step.chunks] == ["c"]
    assert s.kv.stats.prefix_cache_queries == queries + 10


def test_trim_off_pads(small_padding):
    s = Scheduler(dataclasses.replace(CFG, trim_to_bucket=False))
    s.add(seq("a", 3))
    s.update(s.schedule(), [7])
    s.add(seq("b", 5))
    s.add(seq("c", 5))
    assert [c.seq.request_id for c in s.schedule().chunks] == ["b", "c"]
    assert s.trimmed_steps == 0


@pytest.mark.slow
def test_greedy_matches_reference_with_cut_steps(rng, cpu_mesh, small_padding):
    config = get_config("tiny")
    model = LlamaModel(
        config, cpu_mesh(2), dtype=jnp.float32, rngs=nnx.Rngs(int(rng.integers(1 << 30)))
    )
    engine = LLMEngine(model, SMALL_ENGINE)  # weave, 32-row steps in tiles of 8
    arrivals = {0: prompts(rng, (45, 6)), 2: prompts(rng, (21, 9)), 5: prompts(rng, (3, 17))}
    outs = run_with_arrivals(engine, arrivals, SamplingParams(temperature=0.0, max_tokens=6))
    weights = logical_weights(model)
    for out, prompt in zip(outs, [p for s in sorted(arrivals) for p in arrivals[s]], strict=True):
        assert out.token_ids == reference_greedy(weights, config, prompt, 6)[0]
    assert engine.scheduler.trimmed_steps > 0
    assert engine.scheduler.allocator.num_free == SMALL_ENGINE.num_blocks
