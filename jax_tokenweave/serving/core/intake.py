"""The engine's request side, a base of ``serving.core.engine.LLMEngine``: checking and queueing
requests (``add_request``, ``check_request``), aborting them, and reading and releasing their
outputs. A request of ``n`` samples is ``n`` scheduler requests sharing its id. The
scheduler and the request table are only touched under the engine's lock, so these may be
called from another thread while a step runs; the step loop is the engine's.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jax_tokenweave.serving import checks
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.core.deltas import end_delta
from jax_tokenweave.serving.core.requests import EngineRequest, Sample
from jax_tokenweave.serving.outputs import (
    RequestMetrics,
    RequestOutput,
    StreamDelta,
    TextState,
    vllm_logprobs,
)
from jax_tokenweave.serving.sampling import processors
from jax_tokenweave.serving.sampling_params import SamplingParams
from jax_tokenweave.serving.scheduling.scheduler import Request, Scheduler


class RequestIntake:
    """Requests in and outputs out, over state the engine sets up (the attributes below)."""

    config: EngineConfig
    model_config: Any  # the model's DecoderConfig (its vocab_size)
    tokenizer: Any
    eos_token_ids: frozenset[int]
    scheduler: Scheduler
    _requests: dict[str, EngineRequest]
    _lock: threading.RLock  # the scheduler and the request table
    _ids: Iterator[int]  # request ids, where the caller gives none
    _rng: np.random.Generator  # request seeds, where the params give none
    _notices: list[StreamDelta]  # deltas made outside a step (abort, failures)
    closed: bool  # LLMEngine.close was called: its device memory is gone

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(
                f"this {type(self).__name__} is closed (its KV cache was given back): make a "
                f"new one"
            )

    def counts(self) -> tuple[int, int]:
        """Requests ``(running, waiting)`` now, each counted once whatever its ``n``."""
        with self._lock:
            return (
                len({s.request_id for s in self.scheduler.running}),
                len({s.request_id for s in self.scheduler.waiting}),
            )

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request (``params.n`` samples); returns its id. ``ValueError`` (nothing
        queued) for bad token ids, bad params, stop strings without a tokenizer, too many
        logprobs, or a request that could never fit the cache or ``max_model_len``."""
        self._check_open()
        ids, params = self.check_request(prompt_token_ids, params)
        stop_ids = self._stop_ids(params)
        with self._lock:
            rid = str(next(self._ids)) if request_id is None else str(request_id)
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            seed = params.seed if params.seed is not None else int(self._rng.integers(1 << 31))
            samples = [
                Sample(
                    Request(rid, ids, params, params.sample_seed(seed, i), stop_ids, index=i),
                    TextState(self.tokenizer, params.stop) if self.tokenizer is not None else None,
                    [] if params.logprobs is not None else None,
                )
                for i in range(params.n)
            ]
            for sample in samples:
                self.scheduler.add(sample.seq)
            self._requests[rid] = EngineRequest(
                rid,
                prompt,
                ids,
                samples,
                RequestMetrics(time.perf_counter() if arrival_time is None else arrival_time),
                [] if params.prompt_logprobs is not None else None,
            )
        return rid

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that stop a request: its ``stop_token_ids``, and EOS unless ignored."""
        eos = set() if params.ignore_eos else set(self.eos_token_ids)
        return frozenset(set(params.stop_token_ids) | eos)

    def check_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams | None, what: str = "prompt"
    ) -> tuple[list[int], SamplingParams]:
        """The checks of :meth:`add_request` (``ValueError`` naming ``what``), no side effect:
        the prompt's ids as a list and the params (default ``SamplingParams()``; with
        ``max_tokens=None`` resolved to what ``max_model_len`` leaves the prompt)."""
        ids = checks.token_ids(prompt_token_ids, self.model_config.vocab_size, what)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"{what}: params must be a SamplingParams, got {type(params).__name__}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(f"{what}: stop strings need a tokenizer (the engine has none)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(
                    f"{what}: {name}={value} exceeds the engine's max_logprobs "
                    f"({self.config.max_logprobs})"
                )
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"{what}: stop_token_ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias or {}):
            raise ValueError(f"{what}: logit_bias token ids must be in [0, {vocab})")
        biased = len(processors.bias_entries(params, self._stop_ids(params)))
        if biased > self.config.max_biased_tokens:
            raise ValueError(
                f"{what}: logit_bias and the stop tokens min_tokens holds back bias {biased} "
                f"tokens, more than the engine's max_biased_tokens "
                f"({self.config.max_biased_tokens})"
            )
        if params.max_tokens is None:  # vLLM's: up to the model's length
            left = self.config.max_model_len - len(ids)
            if left < 1:
                raise ValueError(
                    f"{what} cannot fit: its {len(ids)} tokens leave no room for a new one in "
                    f"max_model_len ({self.config.max_model_len})"
                )
            try:
                params = dataclasses.replace(params, max_tokens=left)
            except ValueError as err:
                raise ValueError(f"{what}: with max_tokens=None ({left} here): {err}") from None
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"{what}: n={params.n} exceeds max_num_seqs ({self.config.max_num_seqs})"
            )
        try:
            self.scheduler.check_fits(len(ids), params.max_tokens or 0, params.n)
        except ValueError as err:
            raise ValueError(f"{what} cannot fit: {err}") from None
        return ids, params

    def abort(self, request_id: str) -> None:
        """Finish a request's samples now with ``"abort"`` (a no-op for an unknown or finished
        one); the next ``LLMEngine.step`` returns an ``"abort"`` delta per sample. Blocks are
        freed at once, or, where a dispatched step holds them, when that step's tokens are taken
        (by the next ``step``; ``LLMEngine.abort_all`` takes them at once). Taking them here
        would advance the other requests in the middle of a caller's loop over a step's deltas:
        one of those aborted next would then get a token the synchronous engine never makes."""
        self._abort(request_id)

    def _abort(self, request_id: str) -> bool:
        """:meth:`abort`; whether a dispatched step still holds the request's blocks (also
        where it finished already: one that stopped at step n is in step n+1)."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return False
            for sample in request.samples:
                if not sample.seq.finished:
                    self.scheduler.finish(sample.seq, "abort")
                    self._notices.append(end_delta(request, sample))
            return any(sample.seq.in_flight > 0 for sample in request.samples)

    abort_request = abort

    def request_ids(self) -> list[str]:
        """Ids of the requests the engine holds (running, waiting or finished, not released)."""
        with self._lock:
            return list(self._requests)

    def has_unfinished(self) -> bool:
        """Requests waiting or running, blocks held by a step in flight, or deltas that
        ``LLMEngine.step`` has not returned yet."""
        with self._lock:
            return self.scheduler.has_unfinished() or bool(self._notices)

    def output(self, request_id: str) -> RequestOutput:
        """The request's output so far (final once it finished)."""
        with self._lock:
            r = self._requests[request_id]
            prompt_lps = r.prompt_logprobs
            return RequestOutput(
                r.request_id,
                r.prompt_text,
                list(r.prompt_ids),
                [s.completion(self.tokenizer) for s in r.samples],
                r.metrics,
                None if prompt_lps is None else [None, *vllm_logprobs(prompt_lps, self.tokenizer)],
            )

    def release(self, request_id: str) -> RequestOutput:
        """:meth:`output` of a finished request, then forget it."""
        with self._lock:
            out = self.output(request_id)
            if not out.finished:
                raise ValueError(f"request {request_id!r} has not finished")
            del self._requests[request_id]
            self._notices = [d for d in self._notices if d.request_id != request_id]
            return out
