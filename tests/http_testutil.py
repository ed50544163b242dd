"""Starting ``python -m jax_tokenweave.serve`` as a subprocess on a free localhost port, and
reading its ``/metrics``: what the HTTP server's test files share."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
STARTUP_S = 240


def flags(sizes: dict) -> list[str]:
    """``{"max_num_seqs": 4}`` -> ``["--max-num-seqs", "4"]``."""
    return [a for k, v in sizes.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    args: list[str], log: Path, env: dict[str, str] | None = None
) -> tuple[str, subprocess.Popen]:
    """``(base url, process)`` of ``python -m jax_tokenweave.serve ARGS --port P`` once its
    ``/health`` answers 200 (its stdout and stderr into ``log``); fails the test where it exits
    or does not answer within :data:`STARTUP_S` seconds."""
    port = free_port()
    env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jax_tokenweave.serve", *args, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start: {log.read_text()[-3000:]}")
        time.sleep(0.3)


def stop(proc: subprocess.Popen) -> None:
    """Kill the server where it still runs."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(tokenweave_[^\s]+)\s+([-+\de.na]+)$", text, re.MULTILINE)
    }


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """The metrics once no request runs or waits and no KV block is in use."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (
            m["tokenweave_num_requests_running"],
            m["tokenweave_num_requests_waiting"],
            m["tokenweave_kv_blocks_in_use"],
        ) == (0, 0, 0):
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


def is_openai_error(body: dict, status: int) -> bool:
    """Whether ``body`` is OpenAI's error object for ``status``, with a message."""
    error = body.get("error")
    return (
        set(body) == {"error"}
        and isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and error["code"] == status
        and bool(error["message"])
        and isinstance(error["type"], str)
    )
