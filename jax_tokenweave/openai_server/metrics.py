"""The server's Prometheus metrics (``prometheus-client``), in a registry of its own.

Requests by outcome, time to first token and per output token, running / waiting requests, KV
blocks in use / cached / total, preemptions, prefix cache queries and hits (tokens), prompt and
generation tokens and the generation rate over :data:`RATE_WINDOW_S` seconds. Metric names and
labels: docs/SERVING.md#openai_servermetrics.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

RATE_WINDOW_S = 10.0
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
STATUSES = ("stop", "length", "abort", "error", "rejected", "invalid")


class Metrics:
    """The metrics of one server over ``engine`` (an ``LLMEngine``), thread-safe."""

    def __init__(self, engine: Any) -> None:
        self.registry = reg = CollectorRegistry()
        self.requests = Counter(
            "tokenweave_requests", "Requests by how they ended", ["status"], registry=reg
        )
        for status in STATUSES:
            self.requests.labels(status)
        self.ttft = Histogram(
            "tokenweave_time_to_first_token_seconds",
            "Time to first token",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            "tokenweave_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "tokenweave_prompt_tokens", "Prompt tokens admitted", registry=reg
        )
        self.generation_tokens = Counter(
            "tokenweave_generation_tokens", "Tokens generated", registry=reg
        )
        Gauge("tokenweave_num_requests_running", "Requests running", registry=reg).set_function(
            lambda: engine.counts()[0]
        )
        Gauge(
            "tokenweave_num_requests_waiting", "Requests waiting for admission", registry=reg
        ).set_function(lambda: engine.counts()[1])
        Gauge(
            "tokenweave_kv_blocks_in_use", "KV cache blocks held by requests", registry=reg
        ).set_function(lambda: engine.num_blocks_in_use)
        Gauge("tokenweave_kv_blocks_total", "KV cache blocks", registry=reg).set_function(
            lambda: engine.config.num_blocks
        )
        Gauge(
            "tokenweave_kv_blocks_cached", "KV cache blocks in the prefix cache", registry=reg
        ).set_function(lambda: engine.num_blocks_cached)
        reg.register(KVCacheCounters(engine))
        Gauge(
            "tokenweave_generation_tokens_per_second",
            f"Tokens generated per second over the last {RATE_WINDOW_S:g} s",
            registry=reg,
        ).set_function(self.tokens_per_second)
        self._lock = threading.Lock()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def generated(self, count: int) -> None:
        """``count`` tokens were generated now."""
        self.generation_tokens.inc(count)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, count))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(c for _, c in self._recent) / RATE_WINDOW_S

    def finished(self, status: str) -> None:
        self.requests.labels(status).inc()

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)


class KVCacheCounters(Collector):
    """The engine's KV cache counters (``LLMEngine.kv_stats``), read when scraped:
    ``tokenweave_num_preemptions_total``, ``tokenweave_prefix_cache_queries_total`` and
    ``tokenweave_prefix_cache_hits_total`` (prompt tokens, vLLM's meaning)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.engine.kv_stats
        for name, text, value in (
            ("num_preemptions", "Requests preempted (KV blocks taken back)", stats.preemptions),
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                stats.prefix_cache_queries,
            ),
            (
                "prefix_cache_hits",
                "Prompt tokens found in the prefix cache",
                stats.prefix_cache_hits,
            ),
        ):
            yield CounterMetricFamily(f"tokenweave_{name}", text, value=value)
