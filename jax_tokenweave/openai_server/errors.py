"""Every error the server answers, in OpenAI's shape (``{"error": {"message", "type", "param",
"code"}}``, ``protocol.error_body``), and the request body's size limit.

:func:`add_error_handlers`: 400 for a request FastAPI cannot read (not UTF-8, invalid or too
deeply nested JSON) or pydantic refuses (FastAPI's 422), or that names a bad value
(``protocol.BadRequest``); 404 / 405 for an unknown path or model / method; 429 / 503 when
the waiting queue is full / the server drains or cut the request (``async_engine.Overloaded``,
``Cut``); 500 where a step failed or the server itself raised. :class:`BodyLimit`: 413 for a
body over ``max_bytes``, read no further.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from jax_tokenweave.openai_server import protocol as P
from jax_tokenweave.openai_server.async_engine import Cut, EngineFailed, Overloaded
from jax_tokenweave.openai_server.metrics import Metrics

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
"""The default body limit: 4 MiB (a 128k-token prompt as text or token ids takes about 1)."""

log = logging.getLogger("jax_tokenweave.serve")


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error response."""
    return JSONResponse(P.error_body(message, status, param), status_code=status)


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Answer every error of ``app`` in OpenAI's shape (module docstring)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.finished("invalid")
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return error(400, f"invalid JSON: {err.get('msg')}")
        param = loc[0] if loc else None  # the request's field (not a union branch)
        return error(400, f"{'.'.join(loc) or 'body'}: {err.get('msg')}", param)

    @app.exception_handler(HTTPException)
    async def http(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no such path: {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's body parsing
            metrics.finished("invalid")
            cause = exc.__cause__
            message = f"the body is not valid JSON: {type(cause).__name__}: {cause}"
        else:
            message = str(exc.detail)
        response = error(exc.status_code, message)
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(P.BadRequest)
    async def bad(_: Request, exc: P.BadRequest) -> JSONResponse:
        metrics.finished("invalid")
        return error(exc.status, str(exc), exc.param)

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        metrics.finished("rejected")
        return error(exc.status, str(exc))

    @app.exception_handler(Cut)
    async def cut(_: Request, exc: Cut) -> JSONResponse:
        return error(503, str(exc))  # counted as "abort" when cut

    @app.exception_handler(EngineFailed)
    async def failed(_: Request, exc: EngineFailed) -> JSONResponse:
        return error(500, str(exc))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        return error(500, f"internal server error: {type(exc).__name__}: {exc}")


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 in OpenAI's shape (counted
    ``invalid`` in ``metrics``), from its ``content-length`` before any of it is read, or as
    soon as a chunked body passes it; a body within it is read whole, then handed to ``app``."""

    def __init__(self, app: Any, max_bytes: int, metrics: Metrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send, int(length))
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: no one to answer
                log.info("a client left while sending its request")
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, None)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, scope: Any, receive: Any, send: Any, length: int | None) -> None:
        limit = f"{self.max_bytes} bytes, the most this server takes (--max-request-bytes)"
        if length is None:
            message = f"the request body is longer than {limit}"
        else:
            message = f"the request body has {length} bytes, more than {limit}"
        log.info("refused a request body over %d bytes (413)", self.max_bytes)
        self.metrics.finished("invalid")
        response = error(413, message)
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def _replay(messages: list[Any], receive: Any) -> Any:
    """``receive`` that gives ``messages`` first, then the client's."""

    async def replay() -> Any:
        return messages.pop(0) if messages else await receive()

    return replay
