"""Serving: continuous batching with chunked prefill over a paged KV cache, woven steps.

Public: ``LLM``, ``SamplingParams``, ``LLMEngine``, ``EngineConfig``, ``RequestOutput``,
``CompletionOutput``, ``Logprob``, ``StreamDelta``, ``TokenLogprob``, ``count_compilations``,
``generate_ids``. The rooms, bottom up: ``attention``, ``compilation``, ``sampling``,
``scheduling``, ``runner``, ``core`` (the engine), ``offline`` (``LLM``); ``config``,
``sampling_params`` and ``outputs`` hold the public value types, ``cli`` what the command lines
share. The modules' roles: docs/SERVING.md#serving; the design: docs/SERVING.md.
"""

from jax_tokenweave.serving.compilation.compile_count import count_compilations
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.core.engine import LLMEngine
from jax_tokenweave.serving.offline.llm import LLM, RequestFailed
from jax_tokenweave.serving.offline.oneshot import generate_ids
from jax_tokenweave.serving.outputs import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    StreamDelta,
    TokenLogprob,
)
from jax_tokenweave.serving.sampling_params import SamplingParams
from jax_tokenweave.serving.scheduling.blocks import OutOfBlocksError

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
