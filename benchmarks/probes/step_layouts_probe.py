"""Probe (GPU): the serving workload on a synchronous engine, each step timed by its layout.

256 requests of U[128, 1024] prompt tokens, 32 new tokens each, all added at once, after
``warmup()``; per attention implementation, per layout (decode rows, rows): steps, median and
summed milliseconds. A layout whose first step is much slower than its others pays something at
first run (this found XLA building cuDNN plans then). Llama-3-8B shapes, ``LAYERS`` layers.
Run: ``python3 -P benchmarks/probes/step_layouts_probe.py [LAYERS] [IMPL ...]`` (default 8
layers, cudnn and cuda).
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.serving import EngineConfig, LLMEngine, SamplingParams


def run(model: Any, prompts: list[list[int]], attention: str) -> None:
    cfg = EngineConfig(
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        max_model_len=1152,
        num_blocks=18432,
        attention=attention,
        schedule="baseline",
        max_logprobs=0,
        async_scheduling=False,
    )
    engine = LLMEngine(model, cfg)
    engine.warmup()
    last: dict[str, Any] = {}
    pack = engine.runner.pack

    def spy(step: Any) -> Any:
        last["layout"] = (out := pack(step))[0]
        return out

    engine.runner.pack = spy  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    by_layout: dict[tuple[int, int], list[float]] = collections.defaultdict(list)
    start = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        layout = last["layout"]
        by_layout[layout.decode_rows, layout.rows].append((time.perf_counter() - t0) * 1e3)
    print(f"== {attention}: {time.perf_counter() - start:.3f} s in all")
    for (decode, rows), ms in sorted(by_layout.items()):
        print(
            f"   decode rows {decode:4d}, rows {rows:5d}: {len(ms):3d} steps, first "
            f"{ms[0]:8.2f} ms, median {np.median(ms):8.2f} ms, sum {sum(ms):8.1f} ms"
        )


def main(argv: list[str]) -> None:
    layers = int(argv[0]) if argv else 8
    config = bm.load_config("llama3-8b", layers)
    model = LlamaModel(
        config, bm.make_mesh(jax.devices()[:1], 1), dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
    )
    rng = np.random.default_rng(0)
    lengths = rng.integers(128, 1025, 256)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]
    for attention in argv[1:] or ["cudnn", "cuda"]:
        run(model, prompts, attention)


if __name__ == "__main__":
    main(sys.argv[1:])
