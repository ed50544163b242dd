"""The offline API in vLLM's shape, on a tiny Hugging Face checkpoint: a script written for
vLLM runs unchanged but for its import; request outputs with ``n`` samples; prompt and
``sampling_params`` forms; ``tensor_parallel_size`` / ``dtype="auto"`` / ``max_model_len`` /
``gpu_memory_utilization`` / model ids from the local Hugging Face cache; arguments checked where
they enter; and failures that stay with their request: after a request fails inside a step, or
a ``generate()`` is interrupted, the same ``LLM`` serves the next requests as before and no KV
block stays in use."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest
from hf_testutil import CHAT_TEMPLATE, TINY_ENGINE, import_or_skip, save_tiny_llama

from jax_tokenweave.hf.errors import CheckpointError
from jax_tokenweave.serving import LLM, EngineConfig, RequestFailed, SamplingParams
from jax_tokenweave.serving.offline import resolve
from jax_tokenweave.serving.runner import memory

import_or_skip("torch")
import_or_skip("transformers")

SIZES = dict(TINY_ENGINE)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

VLLM_SCRIPT = """
from vllm import LLM, SamplingParams

prompts = ["Hello, my name is", "The capital of France is"]
sampling_params = SamplingParams(n=2, temperature=0.8, top_p=0.95, max_tokens=6)
llm = LLM(model=MODEL, tensor_parallel_size=2, dtype="auto")
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("vllm") / "tiny", 11, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(
        checkpoint, tensor_parallel_size=2, max_model_len=64, num_blocks=64, use_tqdm=False, **SIZES
    )


def idle(llm):
    """No request left, no KV block in use."""
    assert not llm.engine.has_unfinished() and not llm.engine.request_ids()
    assert llm.engine.num_blocks_in_use == 0


@pytest.mark.slow
def test_a_vllm_script_runs_with_only_the_import_changed(checkpoint, capsys):
    code = VLLM_SCRIPT.replace("from vllm import", "from jax_tokenweave import")
    namespace = {"MODEL": checkpoint}
    exec(compile(code, "vllm_script.py", "exec"), namespace)
    outputs, llm = namespace["outputs"], namespace["llm"]
    assert [o.prompt for o in outputs] == ["Hello, my name is", "The capital of France is"]
    for out in outputs:
        assert out.prompt_token_ids == llm.encode(out.prompt) and out.finished
        assert [o.index for o in out.outputs] == [0, 1]
        for o in out.outputs:
            assert 1 <= len(o.token_ids) <= 6 and o.finish_reason in ("stop", "length")
            assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    assert capsys.readouterr().out.count("Prompt: ") == 2
    # vLLM's defaults: dtype from the checkpoint, max_model_len from max_position_embeddings
    assert llm.engine.cache.k[0].dtype == jnp.float32
    assert llm.engine.config.max_model_len == 512
    assert llm.engine.config.num_blocks >= 512 // 16  # sized (CPU fallback)


def test_n_samples_and_vllm_logprobs(llm, rng):
    seed = int(rng.integers(1 << 30))
    params = SamplingParams(
        n=3, temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True, logprobs=2
    )
    (out,) = llm.generate("Sampling", sampling_params=params, use_tqdm=False)
    assert len(out.outputs) == 3 and len({tuple(o.token_ids) for o in out.outputs}) > 1
    (again,) = llm.generate("Sampling", params, use_tqdm=False)  # same seed, same draws
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    first = out.outputs[0]
    assert len(first.logprobs) == 6
    for token, entry, raw in zip(
        first.token_ids, first.logprobs, first.token_logprobs, strict=True
    ):
        assert token in entry and entry[token].logprob == raw.logprob
        top = [t for t, lp in entry.items() if lp.rank is not None]
        assert [entry[t].rank for t in top] == [1, 2]
        assert entry[top[0]].logprob >= entry[top[1]].logprob
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
    assert first.cumulative_logprob == pytest.approx(sum(e.logprob for e in first.token_logprobs))
    (single,) = llm.generate(
        "Sampling", SamplingParams(seed=seed, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert single.outputs[0].token_ids == first.token_ids  # sample 0: the seed's
    idle(llm)


def test_prompt_and_params_forms(llm):
    ids = llm.encode("abc")
    want = llm.generate("abc", GREEDY, use_tqdm=False)[0].token_ids
    for prompts in (
        {"prompt": "abc"},
        {"prompt_token_ids": ids},
        [{"prompt_token_ids": ids}],
        ["abc", {"prompt": "abc"}],
    ):
        outs = llm.generate(prompts, sampling_params=GREEDY, use_tqdm=False)
        assert all(o.token_ids == want and o.outputs[0].token_ids == want for o in outs)
    hot = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    outs = llm.generate(["abc", "abc"], sampling_params=[GREEDY, hot], use_tqdm=False)
    assert outs[0].token_ids == want
    (chat,) = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert chat.prompt_token_ids == llm.encode("user: hi | assistant:")
    idle(llm)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(tensor_parallel_siz=2), TypeError, r"LLM\(\) got an unexpected keyword argument"),
        (dict(dtype="int8"), ValueError, "dtype"),
        (
            dict(max_model_len=1024),
            ValueError,
            "max_model_len=1024 exceeds the model's max_position_embeddings",
        ),
        (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
        (dict(tokenizer=42), ValueError, "LLM tokenizer must be a tokenizer"),
        (dict(tp=2, tensor_parallel_size=4), ValueError, "disagree"),
        (dict(tensor_parallel_size=64), ValueError, "JAX_NUM_CPU_DEVICES=64"),
    ],
)
def test_llm_arguments_checked(checkpoint, kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM(checkpoint, use_tqdm=False, **{"num_blocks": 16, **kwargs})


def test_sampling_params_bounds():
    for kwargs, field in (
        (dict(n=0), "n"),
        (dict(top_k=1 << 31), "top_k"),
        (dict(seed=1 << 32), "seed"),
        (dict(seed=-1), "seed"),
        (dict(temperature=1e39), "temperature"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**kwargs)
    with pytest.raises(TypeError, match="SamplingParams"):
        SamplingParams(best=2)


def test_model_ids_resolve_from_the_local_cache(checkpoint, tmp_path, monkeypatch):
    import shutil

    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--tiny-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copytree(checkpoint, repo / "snapshots" / ("0" * 40))
    assert resolve.checkpoint_dir("tiny-org/tiny-llama") == str(repo / "snapshots" / ("0" * 40))
    llm = LLM(
        "tiny-org/tiny-llama",
        tensor_parallel_size=1,
        num_blocks=16,
        max_model_len=32,
        use_tqdm=False,
        **SIZES,
    )
    assert llm.generate("x", GREEDY, use_tqdm=False)[0].finish_reason == "length"
    with pytest.raises(CheckpointError, match="not a model in the local Hugging Face cache"):
        LLM("tiny-org/not-downloaded", use_tqdm=False)
    with pytest.raises(CheckpointError, match="checkpoint directory does not exist"):
        LLM(str(tmp_path / "nowhere"), use_tqdm=False)


def test_cache_blocks_from_device_memory():
    config = types.SimpleNamespace(
        num_kv_heads=8,
        num_layers=32,
        head_dim=128,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
    )
    engine = EngineConfig(max_model_len=8192, max_num_batched_tokens=8192, block_size=16)
    per_block = memory.block_bytes(config, 16, 1, jnp.bfloat16)
    assert per_block == 2 * 32 * 16 * 8 * 128 * 2  # 2 MiB
    gpu = types.SimpleNamespace(
        memory_stats=lambda: {"bytes_limit": 100 << 30, "bytes_in_use": 16 << 30}
    )
    blocks = resolve.cache_blocks([gpu], config, engine, jnp.bfloat16, 0.9)
    reserve = memory.activation_reserve(config, 8192, 1)
    assert blocks == (int(0.9 * (100 << 30)) - (16 << 30) - reserve) // per_block
    assert resolve.cache_blocks([gpu], config, engine, jnp.bfloat16, 0.5) < blocks
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        resolve.cache_blocks([gpu], config, engine, jnp.bfloat16, 0.17)
    cpu = types.SimpleNamespace(memory_stats=lambda: None)
    assert (
        resolve.cache_blocks([cpu], config, engine, jnp.bfloat16, 0.9)
        == resolve.CPU_CACHE_BYTES // per_block
    )


class FlakyTokenizer:
    """The checkpoint's tokenizer, whose ``decode`` fails for prompts marked ``fail``."""

    def __init__(self, inner, bad_ids):
        self.inner, self.bad_ids, self.chat_template = inner, bad_ids, None

    def encode(self, text, **kw):
        return self.inner.encode(text, **kw)

    def decode(self, ids, **kw):
        if self.bad_ids is not None and list(ids[:1]) == self.bad_ids:
            raise RuntimeError("decode exploded")
        return self.inner.decode(ids, **kw)


def test_a_request_failing_inside_a_step_ends_alone(checkpoint, llm):
    (good,) = llm.generate("fine", GREEDY, use_tqdm=False)
    # the engine decodes each request's new tokens: make one request's decoding fail
    flaky = LLM(
        checkpoint,
        tensor_parallel_size=2,
        max_model_len=64,
        num_blocks=64,
        use_tqdm=False,
        tokenizer=FlakyTokenizer(llm.tokenizer, None),
        **SIZES,
    )
    flaky.tokenizer.bad_ids = [good.token_ids[0]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with pytest.raises(RequestFailed, match=r"prompt 0 failed inside a step: .*decode exploded"):
        flaky.generate(["fine", "other"], params, use_tqdm=False)
    idle(flaky)
    flaky.tokenizer.bad_ids = None
    assert flaky.generate("fine", params, use_tqdm=False)[0].token_ids == good.token_ids
    # a failing step (packing raises): its requests fail, later ones run
    pack = flaky.engine.runner.pack
    flaky.engine.runner.pack = lambda *a: (_ for _ in ()).throw(OverflowError("bad pack"))
    with pytest.raises(RequestFailed, match="bad pack"):
        flaky.generate("fine", params, use_tqdm=False)
    idle(flaky)
    flaky.engine.runner.pack = pack
    assert flaky.generate("fine", params, use_tqdm=False)[0].token_ids == good.token_ids
    idle(flaky)


def test_an_interrupted_generate_frees_everything(llm, rng):
    prompts = [rng.integers(3, 200, int(n)).tolist() for n in rng.integers(5, 20, 3)]
    want = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    fetch, calls = llm.engine.runner.fetch, {"n": 0}

    def interrupted(step):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return fetch(step)

    llm.engine.runner.fetch = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.engine.runner.fetch = fetch
    idle(llm)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    stream = llm.stream(prompts[0], GREEDY)
    next(stream)
    stream.close()
    idle(llm)
    assert np.all(np.asarray(want[0]) >= 0)
