"""``LLMEngine``: continuous batching over a paged KV cache, one jitted step at a time.

``add_request`` queues a request (checked at once: a bad one raises ``ValueError`` and leaves
the others untouched); each :meth:`LLMEngine.step` asks the scheduler for a step
(``serving.scheduler``), packs it (``serving.batch``), runs the jitted model step
(``serving.step``), then advances the requests, finishes those that stop, frees their blocks
and returns what each request gained (:class:`~jax_tokenweave.serving.outputs.StreamDelta`).
``add_request`` and ``abort`` may be called from another thread while a step runs (the async
API does); the scheduler is only touched under the engine's lock.

Compilation: one program per ``StepLayout`` (decode rows x step rows, both bucketed, see
``serving.buckets``); :meth:`LLMEngine.warmup` compiles them all, after which a stream of
requests compiles nothing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jax_tokenweave.serving import batch as batch_lib
from jax_tokenweave.serving import checks
from jax_tokenweave.serving.buckets import decode_rows, next_pow2
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.outputs import (
    RequestMetrics,
    RequestOutput,
    StreamDelta,
    TextState,
    TokenLogprob,
)
from jax_tokenweave.serving.paged_cache import init_paged_cache
from jax_tokenweave.serving.sampling_params import SamplingParams
from jax_tokenweave.serving.scheduler import ScheduledStep, Scheduler
from jax_tokenweave.serving.scheduler import Sequence as Seq
from jax_tokenweave.serving.step import jitted_step


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
        self.model_config = model.config
        self.mesh, self.axis_name = model.mesh, model.axis_name
        self.tp = self.mesh.shape[self.axis_name]
        self.tokenizer = tokenizer
        info = getattr(model, "hf_info", None)
        self.eos_token_ids = frozenset(checks.eos_token_ids(
            eos_token_ids if eos_token_ids is not None
            else (info.eos_token_ids if info is not None else None)))
        self._graphdef, self._state = nnx.split(model)
        self.cache = init_paged_cache(self.model_config, self.mesh, config.num_blocks,
                                      config.block_size, model.embed.get_value().dtype,
                                      self.axis_name)
        self.scheduler = Scheduler(config)
        self.stats = EngineStats()
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.RLock()          # the scheduler and the request table
        self._step_lock = threading.Lock()      # one step at a time (the cache)
        self._ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)

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
        """Finish a request now with ``"abort"``; its blocks are freed at once."""
        with self._lock:
            tracked = self._tracked.get(request_id)
            if tracked is not None and not tracked.seq.finished:
                self.scheduler.finish(tracked.seq, "abort")
                tracked.metrics.finish_time = time.perf_counter()

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished()

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
        """Run one step; what each request gained (module docstring). [] when idle."""
        with self._step_lock:
            with self._lock:
                scheduled = self.scheduler.schedule()
                if scheduled.empty:
                    return []
                layout, arrays = batch_lib.pack(scheduled, self.config, self.model_config,
                                                self.tp)
            outputs = self._run(layout, arrays)
            # to the host: the tokens, and the log-probabilities only where some row asked
            outputs = jax.device_get(outputs if arrays.want_logprobs else
                                     dataclasses.replace(outputs, logprob=None,
                                                         top_logprobs=None, top_ids=None))
            tokens = outputs.tokens[:len(scheduled.sampled)]
            now = time.perf_counter()
            self._count(scheduled, layout)
            with self._lock:
                gained = set(self.scheduler.update(scheduled, tokens.tolist()))
                return [self._delta(seq, i, outputs, now) for i, seq in
                        enumerate(scheduled.sampled) if seq in gained]

    def _run(self, layout: batch_lib.StepLayout, arrays: batch_lib.StepArrays) -> Any:
        cfg = self.config
        outputs, self.cache = jitted_step(
            self._state, self.cache, arrays, graphdef=self._graphdef, layout=layout,
            schedule=cfg.schedule, comm=cfg.comm, key_chunk=cfg.key_chunk,
            num_logprobs=cfg.max_logprobs, tuning=cfg.tuning, attention=cfg.attention)
        return outputs

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
        cfg, tile = self.config, self.config.prefill_tile
        budget = cfg.max_num_batched_tokens
        ladder = sorted({min(next_pow2(n), budget) for n in
                         (tile << i for i in range(budget.bit_length() + 1))} | {budget})
        decodes = sorted({0} | {decode_rows(n, tile) for n in range(1, cfg.max_num_seqs + 1)})
        return [batch_lib.make_layout(d, r, cfg, self.model_config, self.tp)
                for d in decodes for r in ladder if r >= max(d, tile) and r - d <= budget - d]

    def warmup(self, workers: int | None = None) -> int:
        """Compile every layout (traced one after the other, compiled by ``workers`` threads,
        default one per CPU); afterwards no step compiles. Returns how many layouts."""
        cfg = self.config
        lowered = [jitted_step.lower(
            self._state, self.cache, batch_lib.pack_padding(layout, cfg),
            graphdef=self._graphdef, layout=layout, schedule=cfg.schedule, comm=cfg.comm,
            key_chunk=cfg.key_chunk, num_logprobs=cfg.max_logprobs, tuning=cfg.tuning,
            attention=cfg.attention)
            for layout in self.layouts()]
        with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
            list(pool.map(lambda program: program.compile(), lowered))
        return len(lowered)

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
