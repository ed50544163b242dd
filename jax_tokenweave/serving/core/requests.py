"""The engine's request table entries: a request of ``n`` samples, each a scheduler request
(``scheduler.Request``) with its incremental text, log-probabilities and error
(``serving.core.engine``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_tokenweave.serving.outputs import (
    CompletionOutput,
    RequestMetrics,
    TextState,
    TokenLogprob,
    vllm_logprobs,
)
from jax_tokenweave.serving.scheduling import scheduler


@dataclasses.dataclass(eq=False)
class Sample:
    """One sample of a request: its scheduler state, text state, log-probabilities, error."""

    seq: scheduler.Request
    text: TextState | None
    logprobs: list[TokenLogprob] | None
    error: str | None = None

    def completion(self, tokenizer: Any) -> CompletionOutput:
        """The sample's ``CompletionOutput`` so far."""
        lps = None if self.logprobs is None else list(self.logprobs)
        return CompletionOutput(
            self.seq.index,
            None if self.text is None else self.text.text,
            list(self.seq.output),
            None if lps is None else float(sum(e.logprob for e in lps)),
            None if lps is None else vllm_logprobs(lps, tokenizer),
            self.seq.finish_reason,
            lps,
            self.error,
        )


@dataclasses.dataclass(eq=False)
class EngineRequest:
    """A request of ``n`` samples as the engine tracks it."""

    request_id: str
    prompt_text: str | None
    prompt_ids: list[int]
    samples: list[Sample]
    metrics: RequestMetrics
    # per prompt token after the first, where asked (SamplingParams.prompt_logprobs)
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return all(s.seq.finished for s in self.samples)
