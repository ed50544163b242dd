"""Serving: continuous batching with chunked prefill over a paged KV cache, woven steps.

- ``LLM`` (``serving.llm``): the user API, in vLLM's shape: a checkpoint directory, a cached
  Hugging Face model id or a model, and its tokenizer; ``generate``, ``chat``, ``stream``,
  ``astream``; ``serving.resolve``: model ids, ``dtype="auto"``, ``max_model_len`` and the KV
  cache's size from free memory.
- ``SamplingParams`` (``serving.sampling_params``): per-request sampling and stopping.
- ``LLMEngine``, ``EngineConfig`` (``serving.engine``, ``serving.config``): the engine under
  ``LLM``: ``add_request`` / ``step`` / ``abort``; a failure stays with its request.
- ``RequestOutput``, ``CompletionOutput``, ``Logprob``, ``StreamDelta``, ``TokenLogprob``
  (``serving.outputs``): results.
- ``serving.scheduler`` (continuous batching), ``serving.blocks`` (block allocator,
  ``OutOfBlocksError``), ``serving.paged_cache``, ``serving.paged_attention``,
  ``serving.batch`` (step layout), ``serving.step`` (the jitted step), ``serving.runner``
  (the device side of the engine: cache, dispatch, warm-up), ``serving.sampling``.
- ``count_compilations`` (``serving.compile_count``): count XLA compilations (and persistent
  cache hits); ``serving.compilation_cache``: the engine's persistent compilation cache;
  ``serving.executable_cache``: its compiled step programs on disk (``WarmupReport``).
- ``generate_ids(model, prompts, max_new_tokens)`` (``serving.oneshot``): token ids in, token
  ids out, in one call (``LLM.generate`` is the text API; ``LLMEngine.run_to_completion`` serves
  token-id prompts on an engine you keep).
- ``serving.cli``: what the command lines share (argument types, help format, the engine
  options, the devices ``--tp`` needs, known errors in one line).
"""

from typing import Any

from jax_tokenweave._legacy import renamed_attribute
from jax_tokenweave.serving.blocks import OutOfBlocksError
from jax_tokenweave.serving.compile_count import count_compilations
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.engine import LLMEngine
from jax_tokenweave.serving.llm import LLM, RequestFailed
from jax_tokenweave.serving.oneshot import generate_ids
from jax_tokenweave.serving.outputs import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    StreamDelta,
    TokenLogprob,
)
from jax_tokenweave.serving.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "OutOfBlocksError",
    "RequestFailed",
    "RequestOutput",
    "SamplingParams",
    "StreamDelta",
    "TokenLogprob",
    "count_compilations",
    "generate_ids",
]

_RENAMED = {"generate": "jax_tokenweave.serving.oneshot:generate_ids"}  # for one release


def __getattr__(name: str) -> Any:
    return renamed_attribute(__name__, name, _RENAMED)
