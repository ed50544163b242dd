"""``LLM``: the user API, in vLLM's shape: a checkpoint (directory or cached Hugging Face id) or a
model in; text or token ids in and out (``generate``, ``chat``, ``stream``, ``astream``).

Every argument is checked where it enters (``ValueError`` naming it). All callers' requests
are batched together; every way out of a call (error, ``KeyboardInterrupt``, closed stream)
aborts its requests and frees their blocks. What ``LLM(...)`` builds from its arguments is
``serving.offline.llm_setup``'s. Examples and details: docs/SERVING.md#servingofflinellm."""

from __future__ import annotations

import asyncio
import collections
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jax_tokenweave.serving import checks
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.core.engine import LLMEngine
from jax_tokenweave.serving.offline import llm_setup
from jax_tokenweave.serving.offline import prompts as prompt_forms
from jax_tokenweave.serving.offline.llm_setup import (
    TOKENIZER_FILES as TOKENIZER_FILES,  # re-exported
)
from jax_tokenweave.serving.offline.llm_setup import check_tokenizer as check_tokenizer
from jax_tokenweave.serving.offline.llm_setup import load_tokenizer as load_tokenizer
from jax_tokenweave.serving.offline.llm_setup import make_mesh as make_mesh
from jax_tokenweave.serving.outputs import RequestOutput, StreamDelta
from jax_tokenweave.serving.runner import memory
from jax_tokenweave.serving.sampling_params import SamplingParams

Prompt = str | Sequence[int] | Mapping[str, Any]


class RequestFailed(RuntimeError):
    """A request failed inside a step (the engine goes on serving the others)."""


def check_use_tqdm(use_tqdm: Any) -> bool | Callable[..., Any]:
    """``use_tqdm``: a bool, or a callable making a tqdm-like bar (``ValueError`` else)."""
    if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
        raise ValueError(f"use_tqdm must be a bool or a tqdm-like callable, got {use_tqdm!r}")
    return use_tqdm


class LLM:
    """Serve a model (module docstring); vLLM's ``LLM`` arguments where they overlap: ``model`` (a
    checkpoint directory, a cached Hugging Face id, or a ``LlamaModel``), ``tensor_parallel_size``
    (alias ``tp``) or ``mesh``, ``dtype`` (``"auto"``: the checkpoint's), ``max_model_len``,
    ``gpu_memory_utilization`` (sizes ``num_blocks`` unless given), ``tokenizer`` (object,
    directory, None: the checkpoint's, False: none), ``seed``, ``use_tqdm``, ``warmup`` (compile
    every step program first), ``config`` (an ``EngineConfig``; ``**engine`` overrides its
    fields). Each argument: docs/SERVING.md#servingofflinellmllm."""

    def __init__(
        self,
        model: Any,
        *,
        tensor_parallel_size: int | None = None,
        tp: int | None = None,
        mesh: Mesh | None = None,
        dtype: Any = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        tokenizer: Any = None,
        seed: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        warmup: bool = False,
        config: EngineConfig | None = None,
        **engine: Any,
    ) -> None:
        engine = llm_setup.vllm_aliases(engine)  # num_gpu_blocks_override=...
        tp = llm_setup.check_arguments(
            model, engine, config, tp, tensor_parallel_size, gpu_memory_utilization, tokenizer
        )
        self.use_tqdm = check_use_tqdm(use_tqdm)
        tokenizer = llm_setup.tokenizer_source(tokenizer)  # a missing directory: refused now
        bar = tqdm(total=3, desc="LLM: loading weights", disable=not use_tqdm, leave=False)
        with bar:
            model, source = llm_setup.load_model(model, mesh, tp, dtype)
            bar.update()
            bar.set_description("LLM: tokenizer and KV cache")
            try:
                self.tokenizer = llm_setup.resolve_tokenizer(tokenizer, source)
                self.model_path = source
                engine_config = llm_setup.engine_config(
                    model, config, engine, max_model_len, seed, gpu_memory_utilization
                )
                self.engine = LLMEngine(model, engine_config, tokenizer=self.tokenizer)
                bar.update()
                if warmup:
                    bar.set_description("LLM: compiling step programs")
                    self.engine.warmup()
            except BaseException:  # a KV cache too large, an interrupt: the memory goes back
                if hasattr(self, "engine"):
                    self.engine.close()
                if source is not None:
                    memory.delete_arrays(nnx.state(model))
                raise
            bar.update()
        self._sync: dict[str, collections.deque[StreamDelta]] = {}
        self._async: dict[str, asyncio.Queue[StreamDelta | BaseException]] = {}
        self._driver: asyncio.Task[None] | None = None
        self._owns_weights = source is not None  # loaded here from a checkpoint
        # dropped without close(): the engine's memory (and weights loaded here) go back
        self._finalizer = weakref.finalize(self, self.engine.close, self._owns_weights)
        self._finalizer.atexit = False

    # -- life ----------------------------------------------------------------------------
    def close(self) -> None:
        """Give the device memory back: close the engine (``LLMEngine.close``: its KV pool,
        buffers and compiled programs) and delete the weights where this ``LLM`` loaded them
        (a model passed in keeps its own). Also on leaving ``with LLM(...) as llm:`` and when
        the last reference to the ``LLM`` is dropped (its engine with it)."""
        self._finalizer.detach()
        self.engine.close(weights=self._owns_weights)

    @property
    def closed(self) -> bool:
        return self.engine.closed

    def _check_open(self) -> None:
        if self.engine.closed:
            raise RuntimeError(
                "this LLM is closed (its device memory was given back): make a new one"
            )

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- prompts -------------------------------------------------------------------------
    def encode(self, text: str, what: str = "prompt") -> list[int]:
        """Token ids of ``text`` (the tokenizer's special tokens included, e.g. BOS);
        ``ValueError`` naming ``what`` for text no tokenizer takes (``checks.unicode_text``)."""
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (this LLM has none: pass token ids)")
        return list(self.tokenizer.encode(checks.unicode_text(text, what)))

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], what: str = "messages"
    ) -> list[int]:
        """Token ids of one conversation (``prompts.check_messages``: each message a ``role``
        and a ``content``) rendered by the tokenizer's chat template, with the assistant's
        turn opened (``add_generation_prompt``); ``ValueError`` naming ``what``."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages need a tokenizer with a chat template (this LLM has none)")
        text = self.tokenizer.apply_chat_template(
            prompt_forms.check_messages(messages, what), tokenize=False, add_generation_prompt=True
        )
        text = checks.unicode_text(text, what)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prepare(
        self, prompt: Any, params: SamplingParams | None, what: str
    ) -> tuple[str | None, list[int], SamplingParams]:
        text, ids = prompt_forms.one_prompt(prompt, what)
        if ids is None:
            assert text is not None
            if not text:
                raise ValueError(f"{what} is an empty string")
            ids = self.encode(text, what)
        ids, params = self.engine.check_request(ids, params, what)
        return text, ids, params

    def _prepare_all(
        self, prompt_or_prompts: Any, params: Any
    ) -> list[tuple[str | None, list[int], SamplingParams]]:
        each = prompt_forms.prompt_list(prompt_or_prompts)
        if isinstance(params, SamplingParams) or params is None:
            params = [params] * len(each)
        elif not isinstance(params, Sequence) or isinstance(params, str | bytes):
            raise ValueError(
                f"sampling_params must be a SamplingParams or a list of them, got "
                f"{type(params).__name__}"
            )
        elif len(params) != len(each):
            raise ValueError(f"got {len(params)} SamplingParams for {len(each)} prompts")
        return [
            self._prepare(p, sp, f"prompt {i}")
            for i, (p, sp) in enumerate(zip(each, params, strict=True))
        ]

    # -- stepping ------------------------------------------------------------------------
    def _route(self, deltas: list[StreamDelta]) -> None:
        for d in deltas:
            queue = self._sync.get(d.request_id)
            if queue is not None:
                queue.append(d)
            aqueue = self._async.get(d.request_id)
            if aqueue is not None:
                aqueue.put_nowait(d)

    def _close(self, request_id: str) -> None:
        """A stream's end: stop routing, abort the request if it still runs, forget it; its
        blocks are free on return (a step in flight that holds them is taken)."""
        self._sync.pop(request_id, None)
        self._async.pop(request_id, None)
        self.engine.abort_all([request_id], wait=True)

    def _progress(self, use_tqdm: bool | Callable[..., Any] | None, total: int) -> Any:
        """The "Processed prompts" bar of a ``generate`` call of ``total`` prompts."""
        use = self.use_tqdm if use_tqdm is None else check_use_tqdm(use_tqdm)
        if callable(use):
            return use(total=total, desc="Processed prompts", leave=False)
        return tqdm(total=total, disable=not use, desc="Processed prompts", leave=False)

    @staticmethod
    def _raise_failed(out: RequestOutput, what: str) -> None:
        errors = [o.error for o in out.outputs if o.finish_reason == "error"]
        if errors:
            raise RequestFailed(f"{what} failed inside a step: {errors[0]}")

    # -- API -----------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (vLLM's); False, nothing dropped, while a request holds
        blocks."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] | None = None,
    ) -> list[RequestOutput]:
        """Serve the prompts to the end; one ``RequestOutput`` per prompt, in order (each with
        ``n`` outputs). A request that failed inside a step raises ``RequestFailed``.
        ``use_tqdm``: the "Processed prompts" bar (None: the ``LLM``'s ``use_tqdm``; a
        callable: a tqdm-like class to make it with, as vLLM's)."""
        self._check_open()
        prepared = self._prepare_all(prompts, sampling_params)
        ids: list[str] = []
        try:
            ids += [
                self.engine.add_request(tokens, sp, prompt=text) for text, tokens, sp in prepared
            ]
            with self._progress(use_tqdm, len(ids)) as bar:
                left = set(ids)
                while left:
                    self._route(self.engine.step())
                    done = {i for i in left if self.engine.output(i).finished}
                    bar.update(len(done))
                    left -= done
            outs = [self.engine.output(i) for i in ids]
        finally:  # done, an error or an interrupt: nothing of this call stays in the engine
            self.engine.abort_all(ids, wait=True)
        for i, out in enumerate(outs):
            self._raise_failed(out, f"prompt {i}")
        return outs

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] | None = None,
    ) -> list[RequestOutput]:
        """:meth:`generate` of one conversation, or of a list of them (vLLM's), each rendered
        by :meth:`chat_prompt`; one ``RequestOutput`` per conversation."""
        self._check_open()
        ids = [self.chat_prompt(c, what) for what, c in prompt_forms.conversations(messages)]
        return self.generate(
            [{"prompt_token_ids": i} for i in ids], sampling_params, use_tqdm=use_tqdm
        )

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield the request's :class:`StreamDelta` as each step makes a token (others' requests
        advance too); with ``n`` > 1 the samples' deltas interleave (``delta.index``). Closing
        the iterator early aborts the request."""
        self._check_open()
        text, tokens, params = self._prepare(prompt, params, "prompt")
        rid = self.engine.add_request(tokens, params, prompt=text)
        queue: collections.deque[StreamDelta] = collections.deque()
        self._sync[rid] = queue
        try:
            while True:
                while not queue:
                    self._route(self.engine.step())
                delta = queue.popleft()
                if delta.finish_reason == "error":
                    raise RequestFailed(f"the request failed inside a step: {delta.error}")
                yield delta
                if delta.request_finished:
                    return
        finally:
            self._close(rid)

    async def astream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> AsyncIterator[StreamDelta]:
        """:meth:`stream` for asyncio: the steps run in a worker thread, so the event loop stays
        free; concurrent ``astream`` calls are served together."""
        self._check_open()
        text, tokens, params = self._prepare(prompt, params, "prompt")
        rid = self.engine.add_request(tokens, params, prompt=text)
        queue: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()
        self._async[rid] = queue
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        try:
            while True:
                delta = await queue.get()
                if isinstance(delta, BaseException):
                    raise RuntimeError("the serving engine failed") from delta
                if delta.finish_reason == "error":
                    raise RequestFailed(f"the request failed inside a step: {delta.error}")
                yield delta
                if delta.request_finished:
                    return
        finally:  # in a worker thread: it may wait for the driver's step in flight
            self._async.pop(rid, None)
            await asyncio.to_thread(self._close, rid)

    async def _drive(self) -> None:
        try:
            while self.engine.has_unfinished():
                self._route(await asyncio.to_thread(self.engine.step))
        except Exception as err:  # every waiting consumer gets the engine's failure
            for queue in self._async.values():
                queue.put_nowait(err)
