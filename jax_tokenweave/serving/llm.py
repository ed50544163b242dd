"""``LLM``: the user API. A checkpoint directory (or a model) in, text or token ids in and out.

::

    llm = LLM("/path/to/checkpoint", tp=2)
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))
    print(outs[0].text)
    for delta in llm.stream("Once upon a time", SamplingParams(max_tokens=64)):
        print(delta.text, end="")

Prompts are strings (encoded with the checkpoint's tokenizer, ``transformers.AutoTokenizer``)
or sequences of token ids; ``generate`` takes one prompt or a list. Every prompt and every
``SamplingParams`` is checked before anything runs (``ValueError`` naming the prompt). The
engine serves every request of every caller together (continuous batching): ``stream`` and
``astream`` consumers share steps with each other and with ``generate``. Use one LLM either
from synchronous code or from one asyncio event loop at a time.
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jax_tokenweave.serving import checks
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.engine import LLMEngine
from jax_tokenweave.serving.outputs import RequestOutput, StreamDelta
from jax_tokenweave.serving.sampling_params import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
Prompt = str | Sequence[int]


def load_tokenizer(path: str | os.PathLike) -> Any:
    """``transformers.AutoTokenizer`` of a checkpoint directory; None where it has no tokenizer
    files (then prompts and outputs are token ids only)."""
    if not any((Path(path) / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def make_mesh(mesh: Mesh | None, tp: int | None, axis_name: str = "tp") -> Mesh:
    """``mesh`` as given, or a 1-D ``axis_name`` mesh over the first ``tp`` devices (default 1)."""
    if mesh is not None:
        if tp is not None and mesh.shape.get(axis_name) != tp:
            raise ValueError(f"tp={tp} disagrees with the mesh's {axis_name!r} axis "
                             f"({dict(mesh.shape)})")
        return mesh
    tp = 1 if tp is None else checks.at_least(tp, 1, "tp")
    devices = jax.devices()
    if len(devices) < tp:
        raise ValueError(f"tp={tp} needs {tp} devices, have {len(devices)}")
    return Mesh(np.array(devices[:tp]), (axis_name,))


class LLM:
    """Serve a model (module docstring).

    Args:
      model: a Hugging Face checkpoint directory (``jax_tokenweave.from_pretrained``), or a
        model (``models.llama.LlamaModel``).
      tp / mesh: the tensor-parallel degree (the first ``tp`` devices) or a mesh with a
        ``"tp"`` axis; only for a directory.
      dtype: parameter dtype for a directory (default bfloat16).
      tokenizer: a tokenizer object, a directory to load one from, None (the checkpoint's, if
        it has one) or False (none: token ids only).
      config: an ``EngineConfig``; ``**engine`` overrides its fields (``max_num_seqs=...``).
    """

    def __init__(self, model: Any, *, tp: int | None = None, mesh: Mesh | None = None,
                 dtype: Any = None, tokenizer: Any = None, config: EngineConfig | None = None,
                 **engine: Any) -> None:
        source = model if isinstance(model, str | os.PathLike) else None
        if source is not None:
            from jax_tokenweave.models.auto import from_pretrained

            model = from_pretrained(str(source), make_mesh(mesh, tp), dtype)
        elif tp is not None or mesh is not None:
            raise ValueError("tp and mesh apply to a checkpoint directory; a model brings its "
                             "own mesh")
        if isinstance(tokenizer, str | os.PathLike):
            tokenizer = load_tokenizer(tokenizer)
        elif tokenizer is None and source is not None:
            tokenizer = load_tokenizer(source)
        self.tokenizer = tokenizer or None
        config = EngineConfig(**engine) if config is None else (
            EngineConfig(**{**config.__dict__, **engine}) if engine else config)
        self.engine = LLMEngine(model, config, tokenizer=self.tokenizer)
        self._sync: dict[str, collections.deque[StreamDelta]] = {}
        self._async: dict[str, asyncio.Queue[StreamDelta | BaseException]] = {}
        self._driver: asyncio.Task[None] | None = None

    # -- prompts -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (the tokenizer's special tokens included, e.g. BOS)."""
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (this LLM has none: pass token ids)")
        return list(self.tokenizer.encode(text))

    def _prepare(self, prompt: Any, params: SamplingParams | None,
                 what: str) -> tuple[str | None, list[int], SamplingParams]:
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            if not text:
                raise ValueError(f"{what} is an empty string")
            prompt = self.encode(text)
        ids, params = self.engine.check_request(prompt, params, what)
        return text, ids, params

    def _prepare_all(self, prompts: Any, params: Any) -> list[tuple[str | None, list[int],
                                                                    SamplingParams]]:
        if isinstance(prompts, str) or (
                isinstance(prompts, Sequence) and prompts and
                all(not isinstance(t, str | bytes | Sequence | np.ndarray) for t in prompts)):
            prompts = [prompts]                                 # one prompt
        if isinstance(prompts, bytes) or not isinstance(prompts, Sequence | Iterator):
            raise ValueError(f"prompts must be a string, token ids or a list of them, got "
                             f"{type(prompts).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts: give at least one prompt")
        if isinstance(params, SamplingParams) or params is None:
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return [self._prepare(p, sp, f"prompt {i}")
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]

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
        """A stream's end: stop routing, abort the request if it still runs, forget it."""
        self._sync.pop(request_id, None)
        self._async.pop(request_id, None)
        self.engine.abort(request_id)
        self.engine.release(request_id)

    def _finished(self, request_id: str) -> bool:
        return self.engine.output(request_id).finished

    # -- API -----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Serve the prompts to the end; one ``RequestOutput`` per prompt, in order."""
        prepared = self._prepare_all(prompts, params)
        ids = [self.engine.add_request(tokens, sp, prompt=text) for text, tokens, sp in prepared]
        with tqdm(total=len(ids), disable=not use_tqdm, desc="requests") as bar:
            left = set(ids)
            while left:
                self._route(self.engine.step())
                done = {i for i in left if self._finished(i)}
                bar.update(len(done))
                left -= done
        return [self.engine.release(i) for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None
               ) -> Iterator[StreamDelta]:
        """Yield the request's :class:`StreamDelta` as each step makes a token (others' requests
        advance too). Closing the iterator early aborts the request."""
        text, tokens, params = self._prepare(prompt, params, "prompt")
        rid = self.engine.add_request(tokens, params, prompt=text)
        queue: collections.deque[StreamDelta] = collections.deque()
        self._sync[rid] = queue
        try:
            while True:
                while not queue:
                    self._route(self.engine.step())
                delta = queue.popleft()
                yield delta
                if delta.finished:
                    return
        finally:
            self._close(rid)

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None
                      ) -> AsyncIterator[StreamDelta]:
        """:meth:`stream` for asyncio: the steps run in a worker thread, so the event loop stays
        free; concurrent ``astream`` calls are served together."""
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
                yield delta
                if delta.finished:
                    return
        finally:
            self._close(rid)

    async def _drive(self) -> None:
        try:
            while self.engine.has_unfinished():
                self._route(await asyncio.to_thread(self.engine.step))
        except Exception as err:  # every waiting consumer gets the engine's failure
            for queue in self._async.values():
                queue.put_nowait(err)
