"""The FastAPI app: OpenAI's endpoints over an :class:`~jax_tokenweave.serve.async_engine.
AsyncEngine` (module ``serve`` docstring).

Every error is OpenAI's error body (``protocol.error_body``): 400 for a bad request naming the
field (invalid JSON, a wrong type, a value out of range, an empty prompt or message list, an
unknown model, a prompt or ``max_tokens`` beyond ``max_model_len``), 429 / 503 when the waiting
queue is full / the server drains, 500 where a request failed inside a step. A client that
disconnects (streamed or not) aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from jax_tokenweave.serve import protocol as P
from jax_tokenweave.serve.async_engine import AsyncEngine, EngineFailed, Handle, Overloaded
from jax_tokenweave.serve.metrics import Metrics
from jax_tokenweave.serve.render import Collected, Renderer


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class SSEResponse(StreamingResponse):
    """Server-sent events that stop, and close their generator (aborting its requests), as
    soon as the client disconnects, whatever the ASGI server's spec version."""

    media_type = "text/event-stream"
    body_iterator: AsyncGenerator[str, None]  # the events given (``Renderer.stream``'s)

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def stream() -> None:
            with contextlib.suppress(OSError):
                await self.stream_response(send)

        tasks = [
            asyncio.ensure_future(stream()),
            asyncio.ensure_future(self.listen_for_disconnect(receive)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.body_iterator.aclose()


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
        job.cancel()
        watch.cancel()


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


def build_app(llm: Any, *, model_name: str, max_waiting: int = 1024) -> FastAPI:
    """The app over ``llm`` (a ``serving.LLM``); its lifespan starts and stops the loop."""
    metrics = Metrics(llm.engine)
    state = ServerState(llm, AsyncEngine(llm.engine, metrics, max_waiting), metrics, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        yield
        state.engine.stop()

    app = FastAPI(title="jax-tokenweave", lifespan=lifespan)
    app.state.server = state
    _add_error_handlers(app, metrics)
    _add_routes(app, state)
    return app


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, status, param), status_code=status)


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.finished("invalid")
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return _error(400, f"invalid JSON: {err.get('msg')}")
        param = loc[0] if loc else None  # the request's field (not a union branch)
        return _error(400, f"{'.'.join(loc) or 'body'}: {err.get('msg')}", param)

    @app.exception_handler(P.BadRequest)
    async def bad(_: Request, exc: P.BadRequest) -> JSONResponse:
        metrics.finished("invalid")
        return _error(exc.status, str(exc), exc.param)

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        metrics.finished("rejected")
        return _error(exc.status, str(exc))

    @app.exception_handler(EngineFailed)
    async def failed(_: Request, exc: EngineFailed) -> JSONResponse:
        return _error(500, str(exc))


def _add_routes(app: FastAPI, state: ServerState) -> None:
    renderer = Renderer(state)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.accepting:
            return _error(503, "the server is shutting down")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> P.ModelList:
        path = state.llm.model_path
        return P.ModelList(
            data=[
                P.ModelCard(
                    id=state.model_name,
                    created=P.now(),
                    root=path,
                    max_model_len=state.max_model_len,
                )
            ]
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(req: P.CompletionRequest, raw: Request) -> Any:
        renderer.check_model(req.model)
        prompts = renderer.completion_prompts(req)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params = P.sampling_params(req, max_tokens, req.logprobs)
        return await _serve(raw, state, renderer, "cmpl", prompts, params, req, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: P.ChatCompletionRequest, raw: Request) -> Any:
        renderer.check_model(req.model)
        ids = renderer.chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(state.max_model_len - len(ids), 1)  # vLLM's default
        if req.top_logprobs is not None and not req.logprobs:
            raise P.BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = P.sampling_params(req, max_tokens, logprobs)
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
    for _, ids in prompts:
        renderer.check_fits(ids, params, "messages" if chat else "prompt")
    rid = P.new_id(prefix)
    handles: list[Handle] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            handles.append(state.engine.add(f"{rid}-{i}", ids, params, text))
    except BaseException:
        for h in handles:
            state.engine.abort(h)
        raise
    if req.stream:
        return SSEResponse(renderer.stream(rid, handles, params, req, chat))
    collect: Callable[[Handle], Awaitable[Collected]] = lambda h: Collected.of(
        state.engine.deltas(h), params.n
    )
    tasks = [asyncio.ensure_future(collect(h)) for h in handles]
    try:
        results = await until_disconnect(raw, asyncio.gather(*tasks))
    except ClientGone:
        return Response(status_code=499)
    finally:
        for task in tasks:
            task.cancel()
    for r in results:
        if r.error is not None:
            return _error(500, f"the request failed inside a step: {r.error}")
    return renderer.response(rid, handles, results, params, chat)
