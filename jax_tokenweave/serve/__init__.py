"""An OpenAI-compatible HTTP server over the serving engine (FastAPI + uvicorn, as vLLM's).

    python -m jax_tokenweave.serve /path/to/checkpoint --tp 2 --host 127.0.0.1 --port 8000

- ``serve.protocol``: the OpenAI request and response schemas (pydantic) and their mapping to
  ``SamplingParams``;
- ``serve.async_engine``: the engine's step loop in one background thread, requests handed to
  it from asyncio (continuous batching across HTTP requests), a bounded waiting queue;
- ``serve.metrics``: Prometheus metrics (``prometheus-client``);
- ``serve.app``: the FastAPI app: ``/v1/models``, ``/v1/completions``,
  ``/v1/chat/completions`` (streamed as server-sent events or not), ``/health``, ``/metrics``;
- ``serve.__main__``: the command line (also the ``jax-tokenweave-serve`` console script).

It needs the ``serve`` extra: ``pip install "jax-tokenweave[serve]"``; importing this package
without it raises an ``ImportError`` that says so.
"""

from __future__ import annotations

import importlib.util

INSTALL_HINT = 'pip install "jax-tokenweave[serve]"'
REQUIRED = ("fastapi", "uvicorn", "pydantic", "prometheus_client")


def missing_dependencies() -> list[str]:
    """The serve extra's modules that cannot be imported here."""
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


if missing_dependencies():
    raise ImportError(f"the HTTP server needs {', '.join(missing_dependencies())}: {INSTALL_HINT}")
