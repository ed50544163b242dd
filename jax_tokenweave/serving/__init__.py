"""Serving: a sharded KV cache, jitted prefill/decode steps, sampling and ``generate``.

- ``Engine``, ``ServingConfig``, ``generate`` (``serving.engine``): the serving loop.
- ``KVCache``, ``init_cache`` (``serving.kv_cache``): contiguous cache sharded over KV heads,
  one cache row per sequence.
- ``sample`` (``serving.sampling``): greedy / temperature + top-p.
- ``count_compilations`` (``serving.compile_count``): count XLA compilations.
- ``serving.checks``: the argument checks (``ValueError`` naming the problem).
"""

from jax_tokenweave.serving.compile_count import count_compilations
from jax_tokenweave.serving.engine import Engine, ServingConfig, generate
from jax_tokenweave.serving.kv_cache import KVCache, init_cache
from jax_tokenweave.serving.sampling import sample

__all__ = ["Engine", "KVCache", "ServingConfig", "count_compilations", "generate",
           "init_cache", "sample"]
