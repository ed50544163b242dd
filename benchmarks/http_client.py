"""``http_bench.py``'s HTTP side: the OpenAI-compatible server started as a subprocess (every
step program compiled before it listens) and a closed loop of asyncio + httpx clients streaming
``POST /v1/completions``, timing each request's tokens as the client sees them."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


async def stream_one(
    client: Any, url: str, model: str, prompt: list[int], n: int
) -> dict[str, Any]:
    """One greedy streaming request of ``n`` tokens: its token counts, TTFT and TPOT."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, times, usage = time.perf_counter(), [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"the server failed the request: {chunk['error']}")
            if chunk.get("choices"):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is None or usage["completion_tokens"] != n or len(times) != n:
        raise RuntimeError(f"expected {n} tokens, got {len(times)} chunks, usage {usage}")
    return {
        "tokens": n,
        "prompt": len(prompt),
        "ttft": times[0] - start,
        "tpot": (times[-1] - times[0]) / (n - 1) if n > 1 else None,
    }


async def closed_loop(
    url: str, model: str, requests: list[tuple[list[int], int]], clients: int
) -> tuple[list[dict[str, Any]], float]:
    """``requests`` through ``clients`` concurrent streams: each request's record, seconds."""
    import httpx

    queue: asyncio.Queue[tuple[list[int], int]] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    records: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                prompt, n = queue.get_nowait()
                records.append(await stream_one(client, url, model, prompt, n))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return records, time.perf_counter() - start


def free_port() -> int:
    """A local TCP port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(a: argparse.Namespace, sizes: dict[str, int], log: Path) -> tuple[Any, str]:
    """A server subprocess (every program compiled before it listens) and its URL."""
    import httpx

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "jax_tokenweave.serve",
        *([a.model] if a.model else ["--random", a.random]),
        *(["--layers", str(a.layers)] if a.layers and not a.model else []),
        "--port",
        str(port),
        "--tp",
        str(a.tp),
        "--dtype",
        a.dtype,
        "--served-model-name",
        "bench",
        "--schedule",
        a.schedule,
        "--engine-seed",
        str(a.seed),
        "--max-logprobs",
        "0",
        "--log-level",
        "debug",
        *[x for k, v in sizes.items() for x in (f"--{k.replace('_', '-')}", str(v))],
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    out = open(log, "w")  # noqa: SIM115 (the server's lifetime)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + a.startup_timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start: {log.read_text()[-3000:]}")
        time.sleep(0.5)
