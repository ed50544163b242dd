"""The engine's device memory: a KV pool that cannot fit beside the weights and a step's working
memory is refused at construction, before it is allocated, with the figures; a closed engine or
``LLM`` (``close()``, ``with``, its last reference dropped) deletes its arrays, so a second
one in the same process gets the memory, and using it after raises a clear error.

CPU devices report no memory statistics, so these tests give the engine a device of
``LIMIT`` bytes whose ``bytes_in_use`` is what JAX holds alive on it (``jax.live_arrays()``):
an engine that is not closed keeps its pool counted, as on a GPU."""

from __future__ import annotations

import gc
import types

import jax
import numpy as np
import pytest
from flax import nnx
from hf_testutil import TINY_ENGINE, import_or_skip, save_tiny_llama

from jax_tokenweave.serving import LLM, LLMEngine, SamplingParams
from jax_tokenweave.serving.offline import llm_setup
from jax_tokenweave.serving.runner import memory

import_or_skip("torch")
import_or_skip("transformers")

SIZES = dict(
    TINY_ENGINE,
    max_model_len=64,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
POOL_BLOCKS = 4000  # 8 MB of float32 K/V for the tiny model (2048 bytes a block)
ROOM_BLOCKS = 6000  # the device's free room beside what was alive before: one pool, not two


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("memory") / "tiny", seed=4)


def live_bytes(device) -> int:
    """Bytes of the buffers alive on ``device`` (each once: arrays may share a buffer)."""
    buffers = {
        s.data.unsafe_buffer_pointer(): s.data.nbytes
        for a in jax.live_arrays()
        if not a.is_deleted()
        for s in a.addressable_shards
        if s.device == device
    }
    return sum(buffers.values())


@pytest.fixture
def small_device(monkeypatch):
    """Devices of a fixed byte limit whose use is what is alive on them."""
    device = jax.devices()[0]
    per_block = 2 * 2 * 4 * 4 * 8 * 4  # K and V, 2 layers, 4 positions, 4 kv heads x 8, f32
    shapes = types.SimpleNamespace(hidden_size=64, intermediate_size=128, vocab_size=256)
    working = memory.activation_reserve(shapes, 32, 1)
    limit = live_bytes(device) + working + ROOM_BLOCKS * per_block

    def stats(devices):
        return [{"bytes_limit": limit, "bytes_in_use": live_bytes(d)} for d in devices]

    monkeypatch.setattr(memory, "device_stats", stats)
    return limit


def test_check_pool_fits_states_the_figures():
    need = memory.PoolNeed(blocks=1000, block_bytes=2 << 20, working=1 << 30)  # 2 GiB + 1
    gpu = "cuda:0"  # a device as the message names it
    memory.check_pool_fits(need, [gpu], [{"bytes_limit": 4 << 30, "bytes_in_use": 1 << 30}])
    memory.check_pool_fits(need, [gpu], [None])  # no statistics (CPU): not checked
    with pytest.raises(ValueError) as err:
        memory.check_pool_fits(need, [gpu], [{"bytes_limit": 4 << 30, "bytes_in_use": 2 << 30}])
    text = str(err.value)
    for part in (
        "does not fit on cuda:0",
        "num_blocks=1000 blocks of 2.00 MiB need 1.95 GiB",
        "plus 1.00 GiB of a step's working memory",
        "only 2.00 GiB are free (2.00 GiB of the allocator's 4.00 GiB limit in use",
        "512 blocks would fit",
        "Lower num_blocks",
        "XLA_PYTHON_CLIENT_MEM_FRACTION",
    ):
        assert part in text, (part, text)


def test_a_pool_too_large_is_refused_and_the_weights_go_back(checkpoint, small_device, monkeypatch):
    loaded = []
    load = llm_setup.load_model

    def recording(*args, **kwargs):
        out = load(*args, **kwargs)
        loaded.append(out[0])
        return out

    monkeypatch.setattr(llm_setup, "load_model", recording)
    with pytest.raises(ValueError, match=r"does not fit on .*would fit"):
        LLM(checkpoint, num_blocks=2 * ROOM_BLOCKS, use_tqdm=False, **SIZES)
    leaves = jax.tree_util.tree_leaves(nnx.state(loaded[0]))
    assert leaves and all(a.is_deleted() for a in leaves)
    # sized by gpu_memory_utilization, the pool fits by construction, all of the memory too
    llm = LLM(checkpoint, gpu_memory_utilization=0.5, use_tqdm=False, **SIZES)
    assert 0 < llm.engine.config.num_blocks < ROOM_BLOCKS // 2 + 10
    llm.close()
    llm = LLM(checkpoint, gpu_memory_utilization=1.0, use_tqdm=False, **SIZES)
    assert ROOM_BLOCKS // 2 < llm.engine.config.num_blocks < ROOM_BLOCKS
    llm.close()


def test_closed_engines_give_their_memory_to_the_next(checkpoint, small_device):
    first = LLM(checkpoint, num_blocks=POOL_BLOCKS, use_tqdm=False, **SIZES)
    want = first.generate("memory", GREEDY)[0].token_ids
    with pytest.raises(ValueError, match="does not fit"):  # the first one still holds its pool
        LLM(checkpoint, num_blocks=POOL_BLOCKS, use_tqdm=False, **SIZES)
    pool, weights = first.engine.cache.k + first.engine.cache.v, first.engine.runner._leaves
    first.close()
    assert all(a.is_deleted() for a in pool) and all(a.is_deleted() for a in weights)
    assert first.closed
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        first.generate("memory", GREEDY)
    with pytest.raises(RuntimeError, match="this LLMEngine is closed"):
        first.engine.add_request([1, 2], GREEDY)
    with pytest.raises(RuntimeError, match="this LLMEngine is closed"):
        first.engine.step()
    first.close()  # twice: nothing more to do
    with LLM(checkpoint, num_blocks=POOL_BLOCKS, use_tqdm=False, **SIZES) as second:
        assert second.generate("memory", GREEDY)[0].token_ids == want
        pool = second.engine.cache.k + second.engine.cache.v
    assert all(a.is_deleted() for a in pool) and second.closed
    third = LLM(checkpoint, num_blocks=POOL_BLOCKS, use_tqdm=False, **SIZES)
    assert third.generate("memory", GREEDY)[0].token_ids == want
    pool = third.engine.cache.k + third.engine.cache.v
    del third  # the last reference: its memory goes back, whatever still refers to the arrays
    gc.collect()
    assert all(a.is_deleted() for a in pool)
    fourth = LLM(checkpoint, num_blocks=POOL_BLOCKS, use_tqdm=False, **SIZES)
    assert fourth.generate("memory", GREEDY)[0].token_ids == want
    fourth.close()


def test_an_engine_keeps_the_weights_it_was_given(checkpoint):
    from jax_tokenweave import from_pretrained

    model = from_pretrained(checkpoint, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",)))
    engine_config = llm_setup.engine_config(
        model, None, dict(SIZES, num_blocks=64), None, None, 0.9
    )
    with LLMEngine(model, engine_config) as engine:
        (out,) = engine.run_to_completion([[1, 2, 3]], GREEDY)
        pool = engine.cache.k + engine.cache.v
    assert all(a.is_deleted() for a in pool)
    assert not any(a.is_deleted() for a in jax.tree_util.tree_leaves(nnx.state(model)))
    llm = LLM(model, config=engine_config, use_tqdm=False)  # a model passed in keeps its weights
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids == out.token_ids
    llm.close()
    again = LLMEngine(model, engine_config)
    assert again.run_to_completion([[1, 2, 3]], GREEDY)[0].token_ids == out.token_ids
    again.close()
