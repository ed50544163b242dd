"""Count XLA compilations, to check that a serving loop does not recompile after warm-up.

Listens to JAX's monitoring event for backend compilation (emitted once per executable
compiled or loaded from the persistent compilation cache, not on a jit cache hit), and to the
persistent cache's hit event; works on jax 0.10 and 0.11.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """``count``: backend compilations seen while the counter is active, ``cache_hits`` of
    which loaded the program from the persistent compilation cache (thread-safe)."""

    def __init__(self) -> None:
        self.count = 0
        self.cache_hits = 0
        self.active = True
        self._lock = threading.Lock()

    def _hit_listener(self, event: str, **_: object) -> None:
        if self.active and event == CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1

    def _listener(self, event: str, duration_secs: float, **_: object) -> None:
        if self.active and event == BACKEND_COMPILE_EVENT:
            with self._lock:
                self.count += 1


@contextlib.contextmanager
def count_compilations() -> Iterator[CompileCounter]:
    """``with count_compilations() as c: ...``; then ``c.count`` is the number of compiles."""
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter._listener)
    jax.monitoring.register_event_listener(counter._hit_listener)
    try:
        yield counter
    finally:
        counter.active = False  # stays inert where JAX cannot unregister listeners
        for name, listener in (
            ("unregister_event_duration_listener", counter._listener),
            ("unregister_event_listener", counter._hit_listener),
        ):
            unregister = getattr(jax.monitoring, name, None)
            if unregister is not None:
                unregister(listener)
