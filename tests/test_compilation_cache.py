"""The engine's persistent compilation cache (``EngineConfig.compilation_cache_dir``): a second
engine of the same model compiles nothing (its programs all come from the cache); a user-set JAX
cache directory and threshold are kept; None leaves JAX alone."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from testutil import fresh_process_jax_cache

from jax_tokenweave.models.configs import get_config
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.serving import EngineConfig, LLMEngine, SamplingParams, count_compilations
from jax_tokenweave.serving.compilation import executable_cache as exe_cache

CFG = EngineConfig(
    max_num_batched_tokens=16,
    max_num_seqs=2,
    prefill_tile=8,
    block_size=4,
    num_blocks=16,
    max_model_len=32,
    key_chunk=8,
    split_threshold=16,
    collective="xla",
)


@pytest.fixture
def jax_cache(monkeypatch):
    """JAX's cache settings as a fresh process has them, restored afterwards."""
    yield from fresh_process_jax_cache(monkeypatch)


@pytest.fixture(scope="module")
def model():
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    return LlamaModel(get_config("tiny"), mesh, dtype=jnp.float32, rngs=nnx.Rngs(5))


@pytest.mark.slow
def test_second_engine_compiles_from_the_cache(model, tmp_path, jax_cache):
    cfg = dataclasses.replace(CFG, compilation_cache_dir=str(tmp_path / "xla"))
    first = LLMEngine(model, cfg)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    with count_compilations() as cold:
        layouts = first.warmup().compiled
    assert cold.count >= layouts and cold.cache_hits == 0
    assert any(p.name != exe_cache.SUBDIR for p in (tmp_path / "xla").iterdir())
    want = first.run_to_completion([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))[
        0
    ].token_ids
    shutil.rmtree(tmp_path / "xla" / exe_cache.SUBDIR)  # JAX's cache alone here
    jax.clear_caches()  # as a new process: nothing compiled in memory
    second = LLMEngine(model, cfg)
    with count_compilations() as warm:
        assert second.warmup().compiled == layouts
        got = second.run_to_completion([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))[
            0
        ].token_ids
    assert warm.cache_hits == warm.count >= layouts and got == want  # all from the cache


def test_user_settings_win_and_none_leaves_jax_alone(model, tmp_path, jax_cache):
    LLMEngine(model, dataclasses.replace(CFG, compilation_cache_dir=None))
    assert jax.config.jax_compilation_cache_dir is None
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
    engine = LLMEngine(model, dataclasses.replace(CFG, compilation_cache_dir=str(tmp_path / "x")))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    assert engine.runner.compilation_cache_dir == str(tmp_path / "mine")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.0
    with pytest.raises(ValueError, match="compilation_cache_dir"):
        dataclasses.replace(CFG, compilation_cache_dir=3)
