"""Helpers shared by the tests: the relative error against a reference, a randomised
``WeaveDecoder``, pure-JAX stand-ins for the fused kernel injected as reducers, JAX's cache
settings of a fresh process, a benchmark script loaded as a module."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_tokenweave.kernel import _ffi, ops
from jax_tokenweave.nn.decoder import WeaveDecoder
from jax_tokenweave.nn.params import named_params
from jax_tokenweave.weave import reducers

GPU_CONFIG = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_heads=8,
    num_kv_heads=4,
    head_dim=128,
    num_layers=2,
)
"""Overrides of the ``tiny`` config for the GPU tests of the decoder stack: bf16-sized rows."""


def build_decoder(config, mesh, dtype, rng: np.random.Generator) -> WeaveDecoder:
    """A decoder with random weights, norm weights randomised too (so a swapped norm shows)."""
    dec = WeaveDecoder(config, mesh, dtype=dtype, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    norms = {
        name: 1 + 0.2 * rng.standard_normal(p[...].shape)
        for name, p in named_params(dec).items()
        if name.endswith(("norm", "layernorm"))
    }
    dec.load_weights(norms, strict=False)
    return dec


def _f64(x) -> np.ndarray:
    if isinstance(x, jax.Array):  # bf16 has no NumPy float64 cast of its own
        x = x.astype(jnp.float32)
    return np.asarray(x, np.float64)


def rel_err(got, want) -> float:
    """``||got - want|| / ||want||`` in float64 (JAX arrays of any float dtype, or NumPy)."""
    got, want = _f64(got), _f64(want)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def run_calls(dec, batch, hidden, calls, jit_opts=True):
    """``dec(hidden, batch, **kw)`` for each ``kw`` in ``calls``, compiled as one program
    (``jit_opts``: XLA's backend optimizations off, for speed on CPU)."""
    graphdef, state = nnx.split(dec)

    def run(state, hidden):
        model = nnx.merge(graphdef, state)
        return [model(hidden, batch, **kw) for kw in calls]

    opts = {"xla_backend_optimization_level": 0} if jit_opts else {}
    return jax.jit(run).lower(state, hidden).compile(compiler_options=opts)(state, hidden)


class FakeKernel:
    """Pure-JAX stand-ins for the kernel's entry points, injected as reducers (no monkeypatching
    of ``_ffi``): they record the call protocol."""

    def __init__(self):
        self.log: list[tuple[str, int, int | None]] = []
        fake = self

        class Sync(reducers.Sharded):
            def combine(self, j, partial, residual, weight):
                fake.log.append(("sync", j, self.next_ctas()))
                return fake._math(partial, residual, weight, self.ctx.axis_name, self.ctx.eps)

        self.sync = lambda ctx: Sync(ctx, "ffi")
        self.overlap = lambda ctx: reducers.Overlap(ctx, start=self.start, done=self.done)

    @staticmethod
    def _math(partial, residual, weight, axis_name, eps):
        n = jax.lax.axis_size(axis_name)
        return ops._xla_rsag(partial, residual, weight, axis_name, n, eps)

    def start(
        self,
        partial,
        residual,
        weight,
        *,
        axis_name,
        mesh,
        eps=1e-6,
        num_ctas=None,
        slot=0,
        algo="auto",
    ):
        self.log.append(("start", slot, num_ctas))
        normed, res = self._math(partial, residual, weight, axis_name, eps)
        return _ffi.Pending(normed, res, partial, residual, weight.astype(jnp.float32))

    def done(self, pending, *, axis_name, mesh, slot=0):
        self.log.append(("done", slot, None))
        return pending.normed, pending.residual_out

    def check_protocol(self):
        """Every start's slot is free, every done's slot is in flight, nothing left over."""
        inflight: set[int] = set()
        for op, slot, _ in self.log:
            if op == "start":
                assert slot not in inflight, self.log
                inflight.add(slot)
            elif op == "done":
                assert slot in inflight, self.log
                inflight.remove(slot)
        assert not inflight, self.log


CACHE_SETTINGS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_enable_compilation_cache",
)


def fresh_process_jax_cache(monkeypatch) -> Iterator[None]:
    """For a fixture: JAX's cache settings as a fresh process has them (the cache on, no
    directory, the default minimum compile time), the engine's choice of cache forgotten;
    restored afterwards (tests run with the cache off: conftest.py)."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    from jax_tokenweave.serving.compilation import compilation_cache as engine_cache

    saved = {name: getattr(jax.config, name) for name in CACHE_SETTINGS}
    monkeypatch.setattr(engine_cache, "_ours", None)
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    jax.config.update("jax_enable_compilation_cache", True)
    cc.reset_cache()
    try:
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        cc.reset_cache()


_ENGINE_PROCESS = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax_tokenweave.models.configs import get_config
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.serving import EngineConfig, LLMEngine, SamplingParams, count_compilations

platform, first, extra = sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
count = 1 if platform == "gpu" else 2  # TP 1 on a GPU, TP 2 over two CPU devices
mesh = Mesh(np.array(jax.devices(platform)[first:first + count]), ("tp",))
model = LlamaModel(get_config("tiny"), mesh, dtype=jnp.float32, rngs=nnx.Rngs(1))
engine = LLMEngine(model, EngineConfig(
    max_num_batched_tokens=32, max_num_seqs=4, prefill_tile=16, block_size=4, num_blocks=48,
    max_model_len=64, key_chunk=8, compilation_cache_dir=sys.argv[1], **extra))
with count_compilations() as compiles:
    report = engine.warmup()
    outs = engine.run_to_completion([[1, 2, 3], [4, 5, 6, 7]], [
        SamplingParams(max_tokens=4, temperature=0.0),
        SamplingParams(max_tokens=4, temperature=1.0, seed=5)])
print(json.dumps({"loaded": report.loaded, "compiled": report.compiled,
                  "seconds": report.seconds, "compilations": compiles.count,
                  "tokens": [o.token_ids for o in outs]}))
"""


def engine_in_new_process(
    cache_dir: Path, platform: str = "cpu", first: int = 2, **config: object
) -> dict:
    """A tiny model's engine in a new Python process, with its executable cache in
    ``cache_dir``: warm-up, then two requests (greedy and sampled). On CPUs a mesh of devices
    ``first`` and ``first + 1``, on GPUs of device ``first``; ``config``: more
    ``EngineConfig`` fields. Returns ``{"loaded", "compiled", "seconds", "compilations",
    "tokens"}``."""
    argv = [str(cache_dir), platform, str(first), json.dumps(config)]
    # On a GPU this process may hold most of its memory: the new one takes what it uses.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run(
        [sys.executable, "-c", _ENGINE_PROCESS, *argv],
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (benchmarks/ is no package), registered in
    ``sys.modules`` under ``name``: dataclasses look their module up there."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _small_engine():
    from jax_tokenweave.serving import EngineConfig

    return EngineConfig(
        max_num_batched_tokens=32,
        max_num_seqs=4,
        prefill_tile=8,
        block_size=4,
        num_blocks=48,
        max_model_len=64,
        key_chunk=8,
        split_threshold=16,
        collective="xla",
        max_logprobs=3,
    )


SMALL_ENGINE = _small_engine()
"""The engine sizes of the tiny model's engine tests (test_serving, test_async_engine, ...)."""
