"""``LLMEngine``: continuous batching over a paged KV cache, one jitted step at a time.

Each :meth:`LLMEngine.step` schedules a step (``serving.scheduling.scheduler``), packs and
dispatches it (``serving.runner.runner``), takes a completed step's tokens and returns what each
request gained (:class:`~jax_tokenweave.serving.outputs.StreamDelta`). With async scheduling (the
default) it dispatches step n+1 before it waits for step n. The request side (checks, queue, aborts,
outputs; callable from other threads) is ``serving.core.intake.RequestIntake``. A failure stays
with its request (``finish_reason="error"``). Details: docs/SERVING.md#servingcoreengine."""

from __future__ import annotations

import collections
import itertools
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jax_tokenweave.serving import checks
from jax_tokenweave.serving.compilation.executable_cache import WarmupReport
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.core.deltas import (
    add_prompt_logprobs,
    end_delta,
    mark_last,
    sample_delta,
)
from jax_tokenweave.serving.core.intake import RequestIntake
from jax_tokenweave.serving.core.stats import EngineStats
from jax_tokenweave.serving.outputs import RequestOutput, StreamDelta
from jax_tokenweave.serving.runner import batch as batch_lib
from jax_tokenweave.serving.runner import memory
from jax_tokenweave.serving.runner.runner import InFlight, ModelRunner
from jax_tokenweave.serving.sampling_params import SamplingParams
from jax_tokenweave.serving.scheduling.prefix_cache import KVCacheStats
from jax_tokenweave.serving.scheduling.scheduler import Request, ScheduledStep, Scheduler


class LLMEngine(RequestIntake):
    """Serves a causal LM (``models.llama.LlamaModel`` or a subclass) with continuous batching.

    ``tokenizer``: anything with ``decode(ids, skip_special_tokens=True)`` (text outputs and stop
    strings need one). ``eos_token_ids``: stop tokens of every request (default: the
    checkpoint's, ``model.hf_info``). The model's weights are read at construction.
    """

    def __init__(
        self,
        model: Any,
        config: EngineConfig | None = None,
        *,
        tokenizer: Any = None,
        eos_token_ids: int | Sequence[int] | None = None,
    ) -> None:
        checks.model_object(model, "LLMEngine model")
        if config is not None and not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(
                f"tokenizer must have a decode method (a transformers tokenizer), "
                f"got {type(tokenizer).__name__}"
            )
        self.config = config = config or EngineConfig()
        self.runner = ModelRunner(model, config)
        self.model_config, self.tp = self.runner.model_config, self.runner.tp
        self.mesh, self.axis_name = self.runner.mesh, self.runner.axis_name
        self.tokenizer = tokenizer
        info = getattr(model, "hf_info", None)
        self.eos_token_ids = frozenset(
            checks.eos_token_ids(
                eos_token_ids
                if eos_token_ids is not None
                else (info.eos_token_ids if info is not None else None)
            )
        )
        self.scheduler = Scheduler(config)
        self.stats = EngineStats()
        self._requests = {}
        self._lock = threading.RLock()  # the scheduler and the request table
        self._step_lock = threading.Lock()  # one step at a time (the cache)
        self._ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self._inflight: collections.deque[InFlight] = collections.deque()  # tokens not taken
        self._notices = []  # deltas made outside step() (abort, failures)
        self.closed = False
        # dropped without close(): the pool and buffers go back all the same
        self._finalizer = weakref.finalize(self, self.runner.close)
        self._finalizer.atexit = False

    # -- life ----------------------------------------------------------------------------
    def close(self, weights: bool = False) -> None:
        """Abort every request and give the engine's device memory back (the KV pool, the step
        buffers, its compiled programs; with ``weights`` the model's weights too, which it
        shares with the model object); using it afterwards raises ``RuntimeError``. Also on
        leaving ``with LLMEngine(...)``, and when the engine's last reference is dropped."""
        if self.closed:
            return
        with self._step_lock, self._lock:
            for rid in list(self._requests):
                self._abort(rid)
            self._requests.clear()
            self._notices = []
            memory.delete_arrays([step.outputs for step in self._inflight])
            self._inflight.clear()
            self.closed = True
            self._finalizer.detach()
            self.runner.close(weights)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def cache(self) -> Any:
        """The paged KV cache (``serving.attention.paged_cache.PagedKVCache``)."""
        return self.runner.cache

    @property
    def _state(self) -> Any:
        return self.runner.state

    @property
    def _graphdef(self) -> Any:
        return self.runner.graphdef

    @property
    def num_blocks_in_use(self) -> int:
        """KV cache blocks held by requests (waiting for a step in flight included)."""
        return self.config.num_blocks - self.scheduler.allocator.num_free

    @property
    def num_blocks_cached(self) -> int:
        """KV cache blocks in the prefix cache (in use or not)."""
        return self.scheduler.allocator.num_cached

    @property
    def kv_stats(self) -> KVCacheStats:
        """Preemptions and prefix-cache queries and hits (in tokens) since the engine was made."""
        return self.scheduler.kv.stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``); False, nothing dropped,
        where a request holds blocks."""
        with self._lock:
            return self.scheduler.allocator.reset_cache()

    # -- stepping ------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Run one step; what each request gained from one completed step (module docstring),
        and the abort and failure deltas since the last call. [] when idle."""
        with self._step_lock:
            self._check_open()
            depth = 2 if self.config.async_scheduling else 1
            if not self._inflight:
                self._dispatch_next()
            if self._inflight and len(self._inflight) < depth:
                self._dispatch_next()  # step n+1 out before step n's tokens
            taken = self._take_oldest() if self._inflight else []
            with self._lock:
                notices, self._notices = self._notices, []
                return [d for d in notices + taken if d.request_id in self._requests]

    def _dispatch_next(self) -> None:
        """Schedule, pack and dispatch the next step (nothing when there is nothing to run);
        its decodes take in-flight tokens from the step dispatched before it. A failure
        fails the step's requests (module docstring)."""
        scheduled = None
        try:
            with self._lock:
                scheduled = self.scheduler.schedule()
                if scheduled.empty:
                    return
                packed = self.runner.pack(scheduled)
            self.stats.record(scheduled, packed[0])
            previous = self._inflight[-1] if self._inflight else None
            self._inflight.append(self.runner.dispatch(scheduled, packed, previous))
        except Exception as err:
            if scheduled is None:
                raise
            self._fail_step(scheduled, err)

    def _fail_step(self, scheduled: ScheduledStep, err: BaseException) -> None:
        with self._lock:
            for seq in scheduled.seqs:
                self._fail(seq, err)
            self.scheduler.drop(scheduled)

    def _fail(self, seq: Request, err: BaseException) -> None:
        """Finish ``seq``'s request with ``"error"`` (each sample) and queue its deltas."""
        request = self._requests.get(seq.request_id)
        if request is None:
            self.scheduler.finish(seq, "error")
            return
        for sample in request.samples:
            if not sample.seq.finished:
                sample.error = f"{type(err).__name__}: {err}"
                self.scheduler.finish(sample.seq, "error")
                self._notices.append(end_delta(request, sample))

    def _take_oldest(self) -> list[StreamDelta]:
        """Wait for the oldest step in flight's tokens, advance its requests; their deltas."""
        done = self._inflight[0]
        try:
            outputs = self.runner.fetch(done)
            prompt = self.runner.fetch_prompt(done)
        except Exception as err:
            self._inflight.popleft()
            self._fail_step(done.scheduled, err)
            return []
        now = time.perf_counter()
        sampled = done.scheduled.sampled
        with self._lock:
            self._inflight.popleft()
            if prompt is not None:
                add_prompt_logprobs(self._requests, done.asked, prompt)
            gained = set(
                self.scheduler.update(done.scheduled, outputs.tokens[: len(sampled)].tolist())
            )
            deltas = []
            for i, seq in enumerate(sampled):
                if seq not in gained:
                    continue
                try:
                    deltas.append(
                        sample_delta(
                            self._requests[seq.request_id],
                            seq,
                            i,
                            outputs,
                            now,
                            self.scheduler.finish,
                        )
                    )
                except Exception as err:
                    self._fail(seq, err)
            return mark_last(deltas, self._requests)

    # -- conveniences --------------------------------------------------------------------
    def run_to_completion(
        self,
        prompts: Iterable[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Serve token-id prompts to the end, alongside anything already queued (whose deltas
        this drops: read those requests' :meth:`output`); results in prompt order. Every prompt
        is checked before any is queued. (``LLM.generate`` is the text API's.)"""
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts: give at least one prompt")
        per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"got {len(per)} SamplingParams for {len(prompts)} prompts")
        for i, (p, sp) in enumerate(zip(prompts, per, strict=True)):
            self.check_request(p, sp, f"prompt {i}")
        ids: list[str] = []
        try:
            ids += [self.add_request(p, sp) for p, sp in zip(prompts, per, strict=True)]
            while any(not self._requests[i].finished for i in ids):
                self.step()
            return [self.output(i) for i in ids]
        finally:  # done, interrupted or failed: nothing of this call stays in the engine
            self.abort_all(ids, wait=True)

    def abort_all(self, request_ids: Iterable[str], wait: bool = False) -> None:
        """Abort (those still running) and forget these requests (unknown ids ignored). Where
        a dispatched step still holds their blocks (async scheduling: a request that stopped
        at step n is in step n+1), that step's tokens are taken here, so the blocks are free
        on return: at once where no other thread steps, else (``wait``) after its step."""
        request_ids = list(request_ids)
        held = [self._abort(rid) for rid in request_ids]
        if any(held) and self._step_lock.acquire(blocking=wait):
            try:  # take the steps in flight now; the next step() returns their deltas
                while self._inflight:
                    self._notices += self._take_oldest()
            finally:
                self._step_lock.release()
        with self._lock:
            for rid in request_ids:
                self._requests.pop(rid, None)
            self._notices = [d for d in self._notices if d.request_id in self._requests]

    def layouts(self) -> list[batch_lib.StepLayout]:
        """Every step layout this configuration can produce."""
        return self.runner.layouts()

    def warmup(self, workers: int | None = None, progress: bool = False) -> WarmupReport:
        """Make every layout's program, loaded from the executable cache or compiled
        (``ModelRunner.warmup``); afterwards no step compiles. Returns how many layouts were
        loaded and compiled, and the seconds it took."""
        self._check_open()
        return self.runner.warmup(workers, progress)
