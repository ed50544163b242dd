"""``generate_ids``: token ids in, new token ids out, in one call (an engine made for the
call)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax_tokenweave.serving import checks
from jax_tokenweave.serving.buckets import next_pow2
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.core.engine import LLMEngine
from jax_tokenweave.serving.sampling_params import SamplingParams


def generate_ids(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 32,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_ids: int | Sequence[int] | None = None,
    config: EngineConfig | None = None,
) -> list[list[int]]:
    """Token ids in, new token ids out: a new :class:`LLMEngine` (and its compilations) per
    call; keep an engine (or an ``LLM``) to serve a stream. Without ``config``, one sized for
    these prompts (CPU-friendly: a 256-row budget, 16-row tiles)."""
    prompts = list(prompts)
    if config is None:
        longest = max((len(p) for p in prompts if hasattr(p, "__len__")), default=1)
        new = checks.at_least(max_new_tokens, 1, "max_new_tokens")
        config = EngineConfig(
            max_num_batched_tokens=256,
            max_num_seqs=8,
            prefill_tile=16,
            max_model_len=next_pow2(longest + new),
            key_chunk=64,
            num_blocks=8 * next_pow2(longest + new) // 16,
            seed=seed,
        )
    params = SamplingParams(
        temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_new_tokens
    )
    engine = LLMEngine(model, config, eos_token_ids=eos_token_ids)
    return [out.token_ids for out in engine.run_to_completion(prompts, params)]
