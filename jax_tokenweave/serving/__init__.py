"""Serving: continuous batching with chunked prefill over a paged KV cache, woven steps.

Public: ``LLM``, ``SamplingParams``, ``LLMEngine``, ``EngineConfig``, ``RequestOutput``,
``CompletionOutput``, ``Logprob``, ``StreamDelta``, ``TokenLogprob``, ``count_compilations``,
``generate_ids``. The modules' roles: docs/SERVING.md#serving; the design: docs/SERVING.md.
"""

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
