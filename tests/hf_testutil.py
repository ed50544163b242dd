"""Tiny random Hugging Face checkpoints (Llama, Qwen2, Mixtral) for the loading/serving tests.

Built with ``transformers`` on CPU torch and saved with ``save_pretrained`` in small shards, so
every checkpoint is a sharded ``*.safetensors`` set with an index.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import pytest

KINDS = ("llama", "qwen2", "mixtral")


def in_ci() -> bool:
    """Whether the environment variable ``CI`` is set (to anything but "", "0" or "false")."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def import_or_skip(name: str) -> ModuleType:
    """``pytest.importorskip(name)`` outside CI; under CI (:func:`in_ci`) a plain import, so a
    missing ``torch``/``transformers`` fails the test module's collection instead of skipping
    it."""
    if in_ci():
        return importlib.import_module(name)
    return pytest.importorskip(name)


_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=256,
    max_position_embeddings=512,
)


def hf_config(kind: str, **overrides: Any):
    """A tiny ``transformers`` config of ``kind`` (llama has llama3 rope scaling + tied
    embeddings, qwen2 qkv bias, mixtral 4 experts top-2)."""
    import transformers

    kw = dict(_COMMON)
    if kind == "llama":
        kw.update(
            tie_word_embeddings=True,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
        cls = transformers.LlamaConfig
    elif kind == "qwen2":
        cls = transformers.Qwen2Config
    elif kind == "mixtral":
        kw.update(num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.MixtralConfig
    else:
        raise ValueError(kind)
    kw.update(overrides)
    return cls(**kw)


def make_hf_model(kind: str, seed: int = 0, **overrides: Any):
    """A float32 ``transformers`` causal LM of ``kind`` with random weights, in eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = hf_config(kind, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # larger than the default 0.02 init, so the logits are not flat
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


def save_checkpoint(model, path: str, max_shard_size: str = "40KB") -> str:
    """``save_pretrained`` in small safetensors shards (with an index); returns ``path``."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, max_shard_size=max_shard_size, safe_serialization=True)
    return path


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} | "
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
"""A chat template of printable characters only (every one a token of the char tokenizer)."""


def save_char_tokenizer(path: str, vocab_size: int = 256, chat_template: str | None = None) -> str:
    """A character-level fast tokenizer of ``vocab_size`` ids saved into ``path`` (as
    ``save_pretrained`` does): ``<unk>`` 0, ``<s>`` 1 (prepended to every encoding), ``</s>`` 2,
    then printable ASCII and further single characters, so every id decodes to text; with
    ``chat_template`` (e.g. :data:`CHAT_TEMPLATE`) saved in its config."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    chars += [chr(0x100 + k) for k in range(vocab_size - 3 - len(chars))]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return path


TINY_ENGINE = dict(
    max_num_batched_tokens=32,
    max_num_seqs=4,
    prefill_tile=8,
    block_size=4,
    key_chunk=16,
    split_threshold=16,
    collective="xla",
)
"""The engine sizes the tests of a tiny checkpoint share (``LLM(path, **TINY_ENGINE, ...)``)."""


def save_tiny_llama(directory: Any, seed: int, chat_template: str | None = None) -> str:
    """A tiny random Llama checkpoint (``make_hf_model("llama", seed=seed)``) with the
    character tokenizer (:func:`save_char_tokenizer`), saved into ``directory``; its path."""
    path = save_checkpoint(make_hf_model("llama", seed=seed), str(directory))
    return save_char_tokenizer(path, chat_template=chat_template)


def serve_in_process(llm: Any, work: Any, model_name: str) -> Any:
    """``await work(client, raw)`` against the OpenAI-compatible app over ``llm``, in-process
    over an ASGI transport (``openai.AsyncOpenAI``, ``httpx.AsyncClient``), the engine loop
    running; then ``/health`` must answer 200. Returns what ``work`` returned."""
    import asyncio

    import httpx
    import openai

    from jax_tokenweave.openai_server.app import build_app

    app = build_app(llm, model_name=model_name)

    async def main() -> Any:
        app.state.server.engine.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as raw:
                client = openai.AsyncOpenAI(
                    base_url="http://app/v1", api_key="none", http_client=raw, max_retries=0
                )
                out = await work(client, raw)
                assert (await raw.get("/health")).status_code == 200
                return out
        finally:
            app.state.server.engine.stop()

    return asyncio.run(main())


def require_server_stack() -> tuple[ModuleType, ModuleType]:
    """At a test module's import: skip it (fail in CI where torch or transformers is missing:
    :func:`import_or_skip`) unless the server's stack is here; returns ``(httpx, openai)``."""
    import_or_skip("torch")
    import_or_skip("transformers")
    httpx = pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    return httpx, openai
