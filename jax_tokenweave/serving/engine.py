"""``LLMEngine``: continuous batching over a paged KV cache, one jitted step at a time.

``add_request`` queues a request (checked at once: a bad one raises ``ValueError`` and leaves
the others untouched); each :meth:`LLMEngine.step` asks the scheduler for a step
(``serving.scheduler``), packs and dispatches it (``serving.runner``), then takes a completed
step's tokens: advances the requests, finishes those that stop, frees their blocks and returns
what each request gained (:class:`~jax_tokenweave.serving.outputs.StreamDelta`).

Async scheduling (``EngineConfig.async_scheduling``, the default): a step call dispatches step
n+1 before it waits for step n's tokens, so the host schedules and packs while the device
computes and the device never waits for Python; step n+1's decodes take the tokens of step n
on the device. A request that stops at step n (stop token, stop string, abort) drops the token
step n+1 made for it; its blocks are freed after step n+1 is processed. Each call still
returns the deltas of one completed step; the tokens are those of the synchronous engine.

``add_request`` and ``abort`` may be called from another thread while a step runs (the async
API does); the scheduler is only touched under the engine's lock.

Compilation: one program per ``StepLayout``; :meth:`LLMEngine.warmup` loads (from the
executable cache) or compiles them all, after which a stream of requests compiles nothing
(``serving.runner``).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jax_tokenweave.serving import batch as batch_lib
from jax_tokenweave.serving import checks
from jax_tokenweave.serving.buckets import next_pow2
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.executable_cache import WarmupReport
from jax_tokenweave.serving.outputs import (
    RequestMetrics,
    RequestOutput,
    StreamDelta,
    TextState,
    TokenLogprob,
)
from jax_tokenweave.serving.runner import InFlight, ModelRunner
from jax_tokenweave.serving.sampling_params import SamplingParams
from jax_tokenweave.serving.scheduler import ScheduledStep, Scheduler
from jax_tokenweave.serving.scheduler import Sequence as Seq


@dataclasses.dataclass
class EngineStats:
    """Counts since the engine was made: ``steps``, ``split_steps`` (woven in two halves),
    ``cut_steps`` (a request's prompt chunk cut by the split), ``tokens`` (real rows run)."""

    steps: int = 0
    split_steps: int = 0
    cut_steps: int = 0
    tokens: int = 0


@dataclasses.dataclass(eq=False)
class _Tracked:
    seq: Seq
    prompt_text: str | None
    text: TextState | None
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None


class LLMEngine:
    """Serves a causal LM (``models.llama.LlamaModel`` or a subclass) with continuous batching.

    ``tokenizer``: anything with ``decode(ids, skip_special_tokens=True)`` (text outputs and stop
    strings need one). ``eos_token_ids``: stop tokens of every request (default: the
    checkpoint's, ``model.hf_info``). The model's weights are read at construction.
    """

    def __init__(self, model: Any, config: EngineConfig | None = None, *, tokenizer: Any = None,
                 eos_token_ids: int | Sequence[int] | None = None) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config = config or EngineConfig()
        self.runner = ModelRunner(model, config)
        self.model_config, self.tp = self.runner.model_config, self.runner.tp
        self.mesh, self.axis_name = self.runner.mesh, self.runner.axis_name
        self.tokenizer = tokenizer
        info = getattr(model, "hf_info", None)
        self.eos_token_ids = frozenset(checks.eos_token_ids(
            eos_token_ids if eos_token_ids is not None
            else (info.eos_token_ids if info is not None else None)))
        self.scheduler = Scheduler(config)
        self.stats = EngineStats()
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.RLock()          # the scheduler and the request table
        self._step_lock = threading.Lock()      # one step at a time (the cache)
        self._ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self._pending: InFlight | None = None          # dispatched, tokens not taken yet
        self._ready: list[StreamDelta] = []            # a step taken early (abort), to return

    @property
    def cache(self) -> Any:
        """The paged KV cache (``serving.paged_cache.PagedKVCache``)."""
        return self.runner.cache

    @property
    def _state(self) -> Any:
        return self.runner.state

    @property
    def _graphdef(self) -> Any:
        return self.runner.graphdef

    # -- requests ------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    *, request_id: str | None = None, prompt: str | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. ``ValueError`` (nothing queued) for bad token ids,
        bad params, stop strings without a tokenizer, too many logprobs, or a request that
        could never fit the cache or ``max_model_len``."""
        ids, params = self.check_request(prompt_token_ids, params)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos
                                                 else set(self.eos_token_ids))
        with self._lock:
            rid = str(next(self._ids)) if request_id is None else str(request_id)
            if rid in self._tracked:
                raise ValueError(f"request id {rid!r} is already in use")
            seed = params.seed if params.seed is not None else int(self._rng.integers(1 << 31))
            seq = Seq(rid, ids, params, seed, frozenset(stop_ids))
            self.scheduler.add(seq)
            self._tracked[rid] = _Tracked(
                seq, prompt,
                TextState(self.tokenizer, params.stop) if self.tokenizer is not None else None,
                RequestMetrics(time.perf_counter() if arrival_time is None else arrival_time),
                [] if params.logprobs is not None else None)
        return rid

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None,
                      what: str = "prompt") -> tuple[list[int], SamplingParams]:
        """The checks of :meth:`add_request` (``ValueError`` naming ``what``), no side effect:
        the prompt's ids as a list and the params (default ``SamplingParams()``)."""
        ids = checks.token_ids(prompt_token_ids, self.model_config.vocab_size, what)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{what}: params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"{what}: stop strings need a tokenizer (the engine has none)")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"{what}: logprobs={params.logprobs} exceeds the engine's "
                             f"max_logprobs ({self.config.max_logprobs})")
        try:
            self.scheduler.check_fits(len(ids), params.max_tokens)
        except ValueError as err:
            raise ValueError(f"{what} cannot fit: {err}") from None
        return ids, params

    def abort(self, request_id: str) -> None:
        """Finish a request now with ``"abort"``. Its blocks are freed at once, or, where a
        dispatched step holds it, when that step completes: here (waiting for it) unless
        another thread is stepping, else by that thread's step."""
        with self._lock:
            tracked = self._tracked.get(request_id)
            if tracked is None or tracked.seq.finished:
                return
            self.scheduler.finish(tracked.seq, "abort")
            tracked.metrics.finish_time = time.perf_counter()
            held = tracked.seq.in_flight > 0
        if held and self._step_lock.acquire(blocking=False):
            try:    # take the in-flight step now; the next step() returns its deltas
                if self._pending is not None:
                    done, self._pending = self._pending, None
                    self._ready += self._take(done)
            finally:
                self._step_lock.release()

    def has_unfinished(self) -> bool:
        """Requests waiting or running, blocks held by a step in flight, or deltas of a
        completed step that :meth:`step` has not returned yet."""
        with self._lock:
            return self.scheduler.has_unfinished() or bool(self._ready)

    def output(self, request_id: str) -> RequestOutput:
        """The request's output so far (final once it finished)."""
        with self._lock:
            t = self._tracked[request_id]
            return RequestOutput(request_id, t.prompt_text, list(t.seq.prompt),
                                 list(t.seq.output), None if t.text is None else t.text.text,
                                 t.seq.finish_reason,
                                 None if t.logprobs is None else list(t.logprobs), t.metrics)

    def release(self, request_id: str) -> RequestOutput:
        """:meth:`output` of a finished request, then forget it."""
        with self._lock:
            out = self.output(request_id)
            if not out.finished:
                raise ValueError(f"request {request_id!r} has not finished")
            del self._tracked[request_id]
            return out

    # -- stepping ------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Run one step; what each request gained from one completed step (module docstring).
        [] when idle."""
        with self._step_lock:
            if self._ready:
                ready, self._ready = self._ready, []
                return ready
            if not self.config.async_scheduling:
                done = self._dispatch(None)
                return [] if done is None else self._take(done)
            if self._pending is None:
                self._pending = self._dispatch(None)
                if self._pending is None:
                    return []
            done = self._pending
            self._pending = self._dispatch(done)        # step n+1 out before step n's tokens
            return self._take(done)

    def _dispatch(self, previous: InFlight | None) -> InFlight | None:
        """Schedule, pack and dispatch the next step (None when there is nothing to run); its
        decodes take in-flight tokens from ``previous``."""
        with self._lock:
            scheduled = self.scheduler.schedule()
            if scheduled.empty:
                return None
            packed = self.runner.pack(scheduled)
        self._count(scheduled, packed[0])
        return self.runner.dispatch(scheduled, packed, previous)

    def _take(self, done: InFlight) -> list[StreamDelta]:
        """Wait for ``done``'s tokens, advance its requests; their deltas."""
        outputs = self.runner.fetch(done)
        now = time.perf_counter()
        sampled = done.scheduled.sampled
        with self._lock:
            gained = set(self.scheduler.update(done.scheduled,
                                               outputs.tokens[:len(sampled)].tolist()))
            return [self._delta(seq, i, outputs, now) for i, seq in enumerate(sampled)
                    if seq in gained]

    def _count(self, step: ScheduledStep, layout: batch_lib.StepLayout) -> None:
        stats = self.stats
        stats.steps += 1
        stats.tokens += len(step.decodes) + sum(c.length for c in step.chunks)
        if layout.plan.split:
            stats.split_steps += 1
            cut, row = layout.plan.halves[1].start, layout.decode_rows
            for c in step.chunks:
                stats.cut_steps += row < cut < row + c.length
                row += -(-c.length // layout.tile) * layout.tile

    def _delta(self, seq: Seq, row: int, outputs: Any, now: float) -> StreamDelta:
        t = self._tracked[seq.request_id]
        token = seq.output[-1]
        if t.metrics.first_token_time is None:
            t.metrics.first_token_time = now
        logprob = None
        if t.logprobs is not None:
            k = seq.params.logprobs
            top = zip(outputs.top_ids[row, :k].tolist(), outputs.top_logprobs[row, :k].tolist(),
                      strict=True)
            logprob = TokenLogprob(token, float(outputs.logprob[row]), tuple(top))
            t.logprobs.append(logprob)
        text = None
        if t.text is not None:
            if t.text.update(seq.output) and not seq.finished:
                self.scheduler.finish(seq, "stop")
            text = t.text.delta(final=seq.finished)
        if seq.finished:
            t.metrics.finish_time = now
        return StreamDelta(seq.request_id, (token,), text,
                           None if logprob is None else (logprob,), seq.finish_reason)

    # -- conveniences --------------------------------------------------------------------
    def generate(self, prompts: Iterable[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Serve token-id prompts to the end, alongside anything already queued (whose deltas
        this drops: read those requests' :meth:`output`); results in prompt order. Every prompt
        is checked before any is queued."""
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts: give at least one prompt")
        per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"got {len(per)} SamplingParams for {len(prompts)} prompts")
        for i, (p, sp) in enumerate(zip(prompts, per, strict=True)):
            self.check_request(p, sp, f"prompt {i}")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per, strict=True)]
        while any(not self._tracked[i].seq.finished for i in ids):
            self.step()
        return [self.release(i) for i in ids]

    def layouts(self) -> list[batch_lib.StepLayout]:
        """Every step layout this configuration can produce."""
        return self.runner.layouts()

    def warmup(self, workers: int | None = None, progress: bool = False) -> WarmupReport:
        """Make every layout's program, loaded from the executable cache or compiled
        (``ModelRunner.warmup``); afterwards no step compiles. Returns how many layouts were
        loaded and compiled, and the seconds it took."""
        return self.runner.warmup(workers, progress)


def generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             eos_token_ids: int | Sequence[int] | None = None,
             config: EngineConfig | None = None) -> list[list[int]]:
    """Token ids in, new token ids out: a new :class:`LLMEngine` (and its compilations) per
    call; keep an engine (or an ``LLM``) to serve a stream. Without ``config``, one sized for
    these prompts (CPU-friendly: a 256-row budget, 16-row tiles)."""
    prompts = list(prompts)
    if config is None:
        longest = max((len(p) for p in prompts if hasattr(p, "__len__")), default=1)
        new = checks.at_least(max_new_tokens, 1, "max_new_tokens")
        config = EngineConfig(max_num_batched_tokens=256, max_num_seqs=8, prefill_tile=16,
                              max_model_len=next_pow2(longest + new), key_chunk=64,
                              num_blocks=8 * next_pow2(longest + new) // 16, seed=seed)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed,
                            max_tokens=max_new_tokens)
    engine = LLMEngine(model, config, eos_token_ids=eos_token_ids)
    return [out.token_ids for out in engine.generate(prompts, params)]
