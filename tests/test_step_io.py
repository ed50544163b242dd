"""The forward's inputs and logits at fixed addresses (``serving.runner.step_io``): the packed
inputs come back field by field, only the staging copy reads the buffers that change every step, and
the donated buffers are the program's outputs."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_tokenweave.models.configs import get_config
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.serving import EngineConfig, LLMEngine, SamplingParams
from jax_tokenweave.serving.runner import batch as batch_lib
from jax_tokenweave.serving.runner.step import jitted_forward_replayed
from jax_tokenweave.serving.runner.step_io import (
    INPUT_FIELDS,
    input_size,
    new_io,
    pack_inputs,
    stage_inputs,
)

CFG = EngineConfig(
    max_num_batched_tokens=64,
    max_num_seqs=8,
    prefill_tile=16,
    block_size=8,
    num_blocks=32,
    max_model_len=48,
    key_chunk=16,
    schedule="baseline",
    compilation_cache_dir=None,
)


def random_arrays(layout, rng) -> batch_lib.StepArrays:
    arrays = batch_lib.pack_padding(layout, CFG)
    return dataclasses.replace(
        arrays,
        **{
            name: rng.integers(-5, 1000, np.shape(getattr(arrays, name))).astype(np.int32)
            for name in INPUT_FIELDS
        },
    )


@pytest.mark.parametrize("decode,rows", [(8, 8), (16, 48)])
def test_staged_inputs_are_the_packed_fields(rng, decode, rows):
    layout = batch_lib.make_layout(decode, rows, CFG, get_config("tiny"), 1)
    arrays = random_arrays(layout, rng)
    packed = pack_inputs(arrays)
    assert packed.shape == (input_size(layout, CFG.table_width),)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    io = new_io(layout, CFG.table_width, CFG.max_num_seqs, 11, mesh)
    prev = rng.integers(0, 1000, CFG.max_num_seqs).astype(np.int32)
    flat, fields, got_prev = jax.jit(lambda io, p, q: stage_inputs(io, p, q, layout))(
        io, packed, prev
    )
    np.testing.assert_array_equal(flat, np.concatenate([packed, prev]))
    np.testing.assert_array_equal(got_prev, prev)
    for name in INPUT_FIELDS:
        np.testing.assert_array_equal(getattr(fields, name), getattr(arrays, name), err_msg=name)


def test_packed_inputs_that_do_not_fit_the_layout_raise():
    layout = batch_lib.make_layout(8, 8, CFG, get_config("tiny"), 1)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    io = new_io(layout, CFG.table_width, CFG.max_num_seqs, 11, mesh)
    packed = np.zeros(input_size(layout, CFG.table_width) + 1, np.int32)
    with pytest.raises(ValueError, match="do not fit layout"):
        stage_inputs(io, packed, np.zeros(CFG.max_num_seqs, np.int32), layout)


@pytest.fixture(scope="module")
def model():
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    return LlamaModel(get_config("tiny"), mesh, dtype=jnp.float32, rngs=nnx.Rngs(3))


def _users(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(rf"[(, ]%?{re.escape(name)}[,)]", line)]


def test_only_the_staging_copy_reads_the_new_buffers(model):
    """The decode forward reads its per-step buffers (the packed inputs and the previous
    tokens) in one instruction, the staging copy, so XLA's command buffers update one command
    per replay; its StepIO buffers are aliased to the outputs (donated, fixed addresses)."""
    engine = LLMEngine(model, CFG)
    runner = engine.runner
    layout = batch_lib.make_layout(8, 8, CFG, engine.model_config, engine.tp)
    assert runner.replayed(layout)
    args = runner.padding_args(layout)
    compiled = jitted_forward_replayed.lower(*args, **runner._static(layout)).compile()
    text = compiled.as_text()
    entry = text[text.index("ENTRY") :]
    n = input_size(layout, CFG.table_width)
    params = re.findall(r"%?(\S+) = (s32\[\d+\])\S* parameter\((\d+)\)", entry)
    packed = [name for name, shape, _ in params if shape == f"s32[{n}]"]
    prev = [name for name, shape, _ in params if shape == f"s32[{CFG.max_num_seqs}]"]
    slab = [int(i) for _, shape, i in params if shape == f"s32[{n + CFG.max_num_seqs}]"]
    assert len(packed) == len(prev) == len(slab) == 1, params
    readers = {
        line.split("=")[0].strip() for line in _users(entry, packed[0]) + _users(entry, prev[0])
    }
    assert len(readers) == 1, readers
    header = text[: text.index("\n")]
    aliased = dict(re.findall(r"\{(\d+)\}: \((\d+), \{\}", header))  # output -> parameter
    assert aliased.get("0") == str(slab[0]), header  # io.inputs in place
    logits = [i for _, i in re.findall(r"%?(\S+) = f32\[8,\d+\]\S* parameter\((\d+)\)", entry)]
    assert aliased.get("1") in logits, header  # io.logits in place


def test_only_replayed_layouts_keep_buffers(model):
    """A step with prompt chunks keeps no StepIO (its logits would hold [S, V] floats per
    layout between steps); decode-only layouts keep theirs, one per layout."""
    engine = LLMEngine(model, CFG)
    runner = engine.runner
    mixed = batch_lib.make_layout(8, 32, CFG, engine.model_config, engine.tp)
    decode = batch_lib.make_layout(8, 8, CFG, engine.model_config, engine.tp)
    assert runner.io(mixed) is None and runner.io(decode) is runner.io(decode)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert runner._io and all(runner.replayed(layout) for layout in runner._io)
