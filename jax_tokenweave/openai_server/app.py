"""The FastAPI app: OpenAI's endpoints over an :class:`~jax_tokenweave.openai_server.async_engine.
AsyncEngine` (module ``serve`` docstring).

Every error is OpenAI's error body (``openai_server.errors``); a body over ``max_request_bytes`` is
refused (413) before it is parsed. Tokenizing and rendering chat templates run in worker
threads, so ``/health`` and the streams stay responsive. A request's prompts are queued all or
none; more prompts than the waiting queue's bound is a 400. A client that disconnects
(streamed or not) aborts its requests, logged in one line (INFO).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from jax_tokenweave.openai_server import errors
from jax_tokenweave.openai_server import protocol as P
from jax_tokenweave.openai_server.async_engine import AsyncEngine
from jax_tokenweave.openai_server.metrics import Metrics
from jax_tokenweave.openai_server.prompts import Prompts, prompt_name
from jax_tokenweave.openai_server.render import Collected, Renderer

log = logging.getLogger("jax_tokenweave.serve")

STOP_WAIT_S = 0.5
"""At shutdown, how long the engine's loop thread may take to finish its step (a daemon)."""


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class SSEResponse(StreamingResponse):
    """Server-sent events that stop, and close their generator (aborting its requests), as
    soon as the client disconnects, whatever the ASGI server's spec version."""

    media_type = "text/event-stream"
    body_iterator: AsyncGenerator[str, None]  # the events given (``Renderer.stream``'s)

    def __init__(self, events: AsyncGenerator[str, None], request_id: str) -> None:
        super().__init__(events)
        self.request_id = request_id

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def stream() -> None:
            with contextlib.suppress(OSError):
                await self.stream_response(send)

        sending = asyncio.ensure_future(stream())
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait([sending, listening], return_when=asyncio.FIRST_COMPLETED)
            if listening.done() and not sending.done():
                log.info("%s: the client disconnected mid-stream; aborted", self.request_id)
        finally:
            for task in (sending, listening):
                task.cancel()
            await asyncio.gather(sending, listening, return_exceptions=True)
            await self.body_iterator.aclose()


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Take a finished future's exception, so that asyncio does not log it as unretrieved."""
    if not future.cancelled():
        future.exception()


async def until_disconnect(raw: Request, work: Awaitable[Any]) -> Any:
    """``await work``, cancelled (raising :class:`ClientGone`) if the client disconnects."""

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    job, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not job.done():
            raise ClientGone()
        return job.result()
    finally:
        for future in (job, watch):
            future.cancel()
            future.add_done_callback(_retrieve)


@contextlib.contextmanager
def named_as(names: dict[str, str]) -> Iterator[None]:
    """:class:`~protocol.BadRequest` raised inside names the fields as the client sent them
    (``names``: the name used here -> the client's), in ``param`` and in the message."""
    try:
        yield
    except P.BadRequest as err:
        pattern = r"\b(" + "|".join(map(re.escape, names)) + r")\b"
        message = re.sub(pattern, lambda m: names[m.group(1)], str(err)) if names else str(err)
        param = names.get(err.param, err.param) if err.param else None
        raise P.BadRequest(message, param, err.status) from None


@dataclasses.dataclass
class ServerState:
    """What the routes share: the LLM (tokenizer, limits), its engine loop and metrics."""

    llm: Any
    engine: AsyncEngine
    metrics: Metrics
    model_name: str

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.config.max_model_len


def build_app(
    llm: Any,
    *,
    model_name: str,
    max_waiting: int = 1024,
    max_request_bytes: int = errors.DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The app over ``llm`` (a ``serving.LLM``); its lifespan starts and stops the loop."""
    metrics = Metrics(llm.engine)
    state = ServerState(llm, AsyncEngine(llm.engine, metrics, max_waiting), metrics, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        yield
        state.engine.stop(timeout=STOP_WAIT_S)

    app = FastAPI(title="jax-tokenweave", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(errors.BodyLimit, max_bytes=max_request_bytes, metrics=metrics)
    errors.add_error_handlers(app, metrics)
    _add_routes(app, state, Prompts(llm, model_name, max_waiting))
    return app


def _add_routes(app: FastAPI, state: ServerState, prompts: Prompts) -> None:
    renderer = Renderer(state)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.accepting:
            return errors.error(503, "the server is shutting down")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card() -> P.ModelCard:
        return P.ModelCard(
            id=state.model_name,
            created=P.now(),
            root=state.llm.model_path,
            max_model_len=state.max_model_len,
        )

    @app.get("/v1/models")
    async def models() -> P.ModelList:
        return P.ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str) -> Any:
        if model_id != state.model_name:
            return errors.error(
                404,
                f"model {model_id!r} does not exist; this server serves {state.model_name!r}",
                "model",
            )
        return card()

    @app.post("/v1/completions", response_model=None)
    async def completions(req: P.CompletionRequest, raw: Request) -> Any:
        P.check_supported(req)
        prompts.check_model(req.model)
        asked = prompts.listed(req)
        # vLLM's: 16 when absent, up to the model's length when null
        max_tokens = req.max_tokens if "max_tokens" in req.model_fields_set else 16
        echo_logprobs = req.logprobs if req.echo else None  # the prompt's, echoed
        params = P.sampling_params(req, max_tokens, req.logprobs, echo_logprobs)
        pairs = await run_in_threadpool(prompts.completion_prompts, asked)
        for i, (_, ids) in enumerate(pairs):
            prompts.check_fits(ids, params, prompt_name(i, len(pairs)), "prompt")
        return await _serve(raw, state, renderer, "cmpl", pairs, params, req, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: P.ChatCompletionRequest, raw: Request) -> Any:
        P.check_supported(req)
        prompts.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise P.BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        names = {"logprobs": "top_logprobs"}  # the count, which chat calls top_logprobs
        if req.max_tokens is None and req.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        with named_as(names):
            ids = await run_in_threadpool(prompts.chat_prompt, prompts.chat_messages(req))
            max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
            if max_tokens is None:
                max_tokens = max(state.max_model_len - len(ids), 1)  # vLLM's default
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            params = P.sampling_params(req, max_tokens, logprobs)
            prompts.check_fits(ids, params, "messages")
        return await _serve(raw, state, renderer, "chatcmpl", [(None, ids)], params, req, chat=True)


async def _serve(
    raw: Request,
    state: ServerState,
    renderer: Renderer,
    prefix: str,
    prompts: list[tuple[str | None, list[int]]],
    params: Any,
    req: Any,
    chat: bool,
) -> Any:
    rid = P.new_id(prefix)
    handles = state.engine.add(rid, prompts, params)
    echo = prompts if getattr(req, "echo", False) else None  # completions' echo
    if req.stream:
        return SSEResponse(renderer.stream(rid, handles, params, req, chat, echo), rid)
    tasks = [asyncio.ensure_future(Collected.of(state.engine.deltas(h), params.n)) for h in handles]
    try:
        results = await until_disconnect(raw, asyncio.gather(*tasks, return_exceptions=True))
    except ClientGone:
        log.info("%s: the client disconnected; %d request(s) aborted", rid, len(handles))
        return Response(status_code=499)
    finally:
        for task in tasks:
            task.cancel()
    for r in results:
        if isinstance(r, BaseException):
            raise r  # the drain timeout cut it (503), the engine failed (500)
    for r in results:
        if r.error is not None:
            return errors.error(500, f"the request failed inside a step: {r.error}")
    return renderer.response(rid, handles, results, params, chat, echo)
