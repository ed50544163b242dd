"""The engine's step loop in one background thread, fed from asyncio.

:class:`AsyncEngine` owns an ``LLMEngine``: :meth:`add` queues a request's prompts, all or
none (raises :class:`Overloaded`: 429 beyond ``max_waiting``, 503 after :meth:`stop_accepting`);
:meth:`deltas` yields its deltas, and leaving it early aborts the request. A step that raises
fails every request in the engine (:class:`EngineFailed`); the loop goes on with new ones.
:meth:`cut` ends every request with :class:`Cut` (the drain timeout). Threading:
docs/SERVING.md#openai_serverasync_engine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from jax_tokenweave.openai_server.metrics import Metrics
from jax_tokenweave.serving import SamplingParams, StreamDelta

log = logging.getLogger("jax_tokenweave.serve")


class Overloaded(Exception):
    """The server takes no more requests now; ``status``: 429 (queue full) or 503 (draining)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class EngineFailed(RuntimeError):
    """The engine failed a step: every request in it failed."""


class Cut(RuntimeError):
    """The server stopped before the request finished (the drain timeout): 503."""


@dataclasses.dataclass(eq=False)
class Handle:
    """One engine request as the HTTP side sees it."""

    request_id: str
    prompt_tokens: int
    queue: asyncio.Queue[list[StreamDelta] | BaseException]
    arrival: float
    first_token: float | None = None
    generated: int = 0
    done: bool = False


class AsyncEngine:
    """The step loop (module docstring) over ``engine`` (an ``LLMEngine``)."""

    def __init__(self, engine: Any, metrics: Metrics, max_waiting: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.accepting = True
        self._handles: dict[str, Handle] = {}  # touched on the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread, delivering to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenweave-engine", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        """New requests get 503 from now on (shutdown)."""
        self.accepting = False

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what still runs and stop the loop thread."""
        self.accepting = False
        self.engine.abort_all(list(self._handles))
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        """Requests added and not finished."""
        return len(self._handles)

    def cut(self, message: str) -> None:
        """End every request added and not finished with :class:`Cut` (``message``) and abort
        it in the engine (its blocks return to the pool)."""
        handles = list(self._handles.values())
        self._handles.clear()
        self.engine.abort_all([h.request_id for h in handles])
        for handle in handles:
            if not handle.done:
                handle.done = True
                self.metrics.finished("abort")
            handle.queue.put_nowait(Cut(message))
        self._wake.set()

    # -- requests (event loop) -----------------------------------------------------------
    def add(
        self,
        request_id: str,
        prompts: Sequence[tuple[str | None, Sequence[int]]],
        params: SamplingParams,
    ) -> list[Handle]:
        """Queue one engine request per ``(text, token ids)`` of ``prompts`` (ids
        ``{request_id}-{i}``), all or none: ``ValueError`` for a bad one, :class:`Overloaded`
        where they do not all fit the waiting queue now."""
        if not self.accepting:
            raise Overloaded("the server is shutting down", 503)
        waiting = self.engine.counts()[1]
        if waiting + len(prompts) > self.max_waiting:
            raise Overloaded(
                f"too many requests waiting ({waiting} of max_waiting={self.max_waiting}, "
                f"{len(prompts)} more asked); retry later",
                429,
            )
        handles: list[Handle] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                handle = Handle(f"{request_id}-{i}", len(ids), asyncio.Queue(), time.perf_counter())
                self.engine.add_request(
                    ids,
                    params,
                    request_id=handle.request_id,
                    prompt=text,
                    arrival_time=handle.arrival,
                )
                self._handles[handle.request_id] = handle
                handles.append(handle)
        except BaseException:
            for handle in handles:
                self._handles.pop(handle.request_id, None)
                handle.done = True
            self.engine.abort_all([h.request_id for h in handles])
            raise
        self.metrics.prompt_tokens.inc(sum(h.prompt_tokens for h in handles))
        self._wake.set()
        return handles

    def abort(self, handle: Handle) -> None:
        """Abort and forget the request (its blocks return to the pool)."""
        self._handles.pop(handle.request_id, None)
        if not handle.done:
            handle.done = True
            self.engine.abort_all([handle.request_id])
            self.metrics.finished("abort")
            self._wake.set()

    async def deltas(self, handle: Handle) -> AsyncIterator[StreamDelta]:
        """The request's deltas until its last; leaving early aborts it."""
        try:
            while True:
                item = await handle.queue.get()
                if isinstance(item, Cut):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineFailed(f"the engine failed: {item}") from item
                for delta in item:
                    yield delta
                    if delta.request_finished:
                        return
        finally:
            self.abort(handle)

    def _deliver(self, grouped: dict[str, list[StreamDelta]]) -> None:
        now = time.perf_counter()
        for rid, deltas in grouped.items():
            handle = self._handles.get(rid)
            if handle is None:
                continue
            made = sum(len(d.token_ids) for d in deltas)
            if made:
                if handle.first_token is None:
                    handle.first_token = now
                    self.metrics.ttft.observe(now - handle.arrival)
                handle.generated += made
                self.metrics.generated(made)
            last = deltas[-1]
            if last.request_finished:
                handle.done = True
                self._handles.pop(rid, None)
                reasons = [d.finish_reason for d in deltas if d.finish_reason]
                # str(): the label prometheus_client would make of it (a finished request's
                # last delta has its reason; "None" where one has not)
                self.metrics.finished("error" if "error" in reasons else str(last.finish_reason))
                if handle.generated > 1 and handle.first_token is not None:
                    self.metrics.tpot.observe((now - handle.first_token) / (handle.generated - 1))
            handle.queue.put_nowait(deltas)

    def _fail_all(self, err: BaseException) -> None:
        for handle in list(self._handles.values()):
            handle.done = True
            self.metrics.finished("error")
            handle.queue.put_nowait(err)
        self._handles.clear()

    # -- the loop thread -----------------------------------------------------------------
    def _run(self) -> None:
        engine, loop = self.engine, self._loop
        assert loop is not None
        while not self._stopping:
            if not engine.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                deltas = engine.step()
            except Exception as err:
                log.exception("the engine failed a step; failing every request in it")
                engine.abort_all(engine.request_ids())
                loop.call_soon_threadsafe(self._fail_all, err)
                continue
            if not deltas:
                continue
            grouped: dict[str, list[StreamDelta]] = collections.defaultdict(list)
            for d in deltas:
                grouped[d.request_id].append(d)
                if d.request_finished:
                    with contextlib.suppress(KeyError, ValueError):  # forgotten meanwhile
                        engine.release(d.request_id)
            try:
                loop.call_soon_threadsafe(self._deliver, dict(grouped))
            except RuntimeError:  # the event loop closed: shutting down
                return
