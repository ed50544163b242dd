"""An OpenAI-compatible HTTP server over the serving engine (FastAPI + uvicorn).

    python -m jax_tokenweave.serve /path/to/checkpoint --tp 2 --host 127.0.0.1 --port 8000

Modules ``protocol``, ``prompts``, ``async_engine``, ``render``, ``errors``, ``metrics``,
``app``, ``server``; the command line is ``jax_tokenweave/serve.py``. Needs the ``serve`` extra
(``pip install "jax-tokenweave[serve]"``); without it, importing raises ``ImportError`` saying
so. The modules' roles: docs/SERVING.md#openai_server.
"""

from __future__ import annotations

import importlib.util

INSTALL_HINT = 'pip install "jax-tokenweave[serve]"'
REQUIRED = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client")


def missing_dependencies() -> list[str]:
    """The serve extra's modules that cannot be imported here."""
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


if missing_dependencies():
    raise ImportError(f"the HTTP server needs {', '.join(missing_dependencies())}: {INSTALL_HINT}")
