"""Running the app under uvicorn: the startup line once the socket listens, and SIGTERM / Ctrl-C
draining (no new requests: 503; those in flight get ``drain_timeout`` seconds; then the rest
are aborted and the process exits 0)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from jax_tokenweave.serve.app import build_app


class _Server(uvicorn.Server):
    """uvicorn's server, telling the engine to stop taking requests as shutdown starts and
    printing the startup line once it listens."""

    def __init__(
        self, config: uvicorn.Config, state: Any, startup_line: Callable[[int], str]
    ) -> None:
        super().__init__(config)
        self._state = state
        self._startup_line = startup_line

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # drained: exit 0, not re-raise the signal

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._state.engine.stop_accepting()
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.config.port
            for server in getattr(self, "servers", []):
                for sock in server.sockets:
                    port = sock.getsockname()[1]
            print(self._startup_line(port), flush=True)


def run(
    llm: Any,
    name: str,
    host: str,
    port: int,
    *,
    max_waiting: int,
    drain_timeout: float,
    log_level: str,
    startup_line: Callable[[int], str],
) -> int:
    """Serve until SIGTERM / Ctrl-C (module docstring); the exit status."""
    app = build_app(llm, model_name=name, max_waiting=max_waiting)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        # typed int in uvicorn, used as asyncio.wait_for's timeout: seconds, a float is fine
        timeout_graceful_shutdown=drain_timeout,  # type: ignore[arg-type]
        access_log=False,
    )
    server = _Server(config, app.state.server, startup_line)
    server.run()
    print("jax-tokenweave: stopped", file=sys.stderr, flush=True)
    return 0
