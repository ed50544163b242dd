"""Running the app under uvicorn: the startup line once the socket listens, the server's log
lines (logger ``jax_tokenweave.serve`` at ``--log-level``, uvicorn's format), and SIGTERM /
Ctrl-C draining: no new requests (503); those in flight get ``drain_timeout`` seconds; then each
one left ends with OpenAI's error (503: a JSON body, or a stream's ``error`` event and
``data: [DONE]``), and the process exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from uvicorn.logging import DefaultFormatter

from jax_tokenweave.openai_server.app import build_app

GRACE_S = 0.5
"""uvicorn cancels what still runs this long after the drain timeout cut the requests."""


class _Server(uvicorn.Server):
    """uvicorn's server, telling the engine to stop taking requests as shutdown starts, cutting
    those still in flight at the drain timeout, and printing the startup line once it listens."""

    def __init__(
        self,
        config: uvicorn.Config,
        state: Any,
        startup_line: Callable[[int], str],
        drain_timeout: float,
    ) -> None:
        super().__init__(config)
        self._state = state
        self._startup_line = startup_line
        self._drain_timeout = drain_timeout
        self._exit_at: float | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # drained: exit 0, not re-raise the signal

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._exit_at is None:
            self._exit_at = time.monotonic()
        self._state.engine.stop_accepting()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: Any = None) -> None:
        start = self._exit_at if self._exit_at is not None else time.monotonic()
        left = max(0.0, start + self._drain_timeout - time.monotonic())
        message = (
            f"the server shut down before the request finished (drain timeout "
            f"{self._drain_timeout:g} s)"
        )
        cut = asyncio.get_running_loop().call_later(left, self._state.engine.cut, message)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.config.port
            for server in getattr(self, "servers", []):
                for sock in server.sockets:
                    port = sock.getsockname()[1]
            print(self._startup_line(port), flush=True)


def configure_logging(level: str) -> None:
    """The server's own log lines (disconnects, refusals, failed steps) to stderr at ``level``,
    as uvicorn writes its own."""
    logger = logging.getLogger("jax_tokenweave.serve")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def run(
    llm: Any,
    name: str,
    host: str,
    port: int,
    *,
    max_waiting: int,
    max_request_bytes: int,
    drain_timeout: float,
    log_level: str,
    startup_line: Callable[[int], str],
) -> int:
    """Serve until SIGTERM / Ctrl-C (module docstring); the exit status."""
    configure_logging(log_level)
    app = build_app(
        llm, model_name=name, max_waiting=max_waiting, max_request_bytes=max_request_bytes
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        # typed int in uvicorn, used as asyncio.wait_for's timeout: seconds, a float is fine
        timeout_graceful_shutdown=drain_timeout + GRACE_S,  # type: ignore[arg-type]
        access_log=False,
    )
    server = _Server(config, app.state.server, startup_line, drain_timeout)
    server.run()
    print("jax-tokenweave: stopped", file=sys.stderr, flush=True)
    return 0
