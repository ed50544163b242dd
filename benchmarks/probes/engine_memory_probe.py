"""Serving engines one after another in one process, and a pool too large (issue 44).

On one device, with a model of named shapes and random weights (kept across engines): build
``--engines`` engines one after another, each with a KV pool of half the memory free at that
moment, serve a few greedy requests on each, close it; then ask for a pool twice the free
memory and time how long the refusal takes. Writes ``engine_memory.json`` (+ ``.md``) in
``--out``: per engine the free bytes before it, its blocks, the served tokens and seconds; the
refusal's seconds and message; whether every engine's output matched the first's.

    python3 -P benchmarks/probes/engine_memory_probe.py --model llama3-8b --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from jax_tokenweave.harness import benchmarking as bm


def free_bytes(device: Any) -> int:
    """The allocator's limit minus what is in use on ``device`` (0 where it gives no stats)."""
    stats = device.memory_stats() or {}
    return int(stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0))


def too_large(model: Any, config: Any) -> dict[str, Any]:
    """Whether an engine of ``config`` is refused, and the message."""
    from jax_tokenweave.serving import LLMEngine

    try:
        LLMEngine(model, config).close()
        return {"refused": False}
    except ValueError as err:
        return {"refused": True, "message": str(err)[:600]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", help="named shapes (random weights)")
    p.add_argument("--layers", type=bm.positive_int, default=None, help="layers (default: all)")
    p.add_argument("--engines", type=bm.positive_int, default=3, help="engines in a row")
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON and markdown")
    args = p.parse_args(argv)

    import jax.numpy as jnp
    from flax import nnx

    from jax_tokenweave.models.llama import LlamaModel
    from jax_tokenweave.serving import EngineConfig, LLMEngine, SamplingParams
    from jax_tokenweave.serving.runner.memory import block_bytes

    _, devices = bm.start_devices()
    config = bm.load_config(args.model, args.layers)
    model = LlamaModel(config, bm.make_mesh(devices[:1], 1), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    base = dict(
        max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=1024, schedule="baseline"
    )
    per_block = block_bytes(config, EngineConfig().block_size, 1, jnp.bfloat16)
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(64 + 16 * i)] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    engines, first = [], None
    for i in range(args.engines):
        free = free_bytes(devices[0])
        blocks = free // 2 // per_block if free else 64  # CPU: no statistics, a small pool
        t0 = time.perf_counter()
        engine = LLMEngine(model, EngineConfig(**base, num_blocks=blocks))
        outs = [o.outputs[0].token_ids for o in engine.run_to_completion(prompts, greedy)]
        seconds = time.perf_counter() - t0
        engine.close()
        first = first if first is not None else outs
        engines.append(
            dict(
                free_bytes=free,
                blocks=blocks,
                pool_bytes=blocks * per_block,
                seconds=seconds,
                tokens=sum(map(len, outs)),
                same_as_first=outs == first,
            )
        )
        print(f"engine {i}: {engines[-1]}", file=sys.stderr)
    free = free_bytes(devices[0])
    t0 = time.perf_counter()
    if not free:
        refused = {"refused": False, "reason": "no memory statistics on this device"}
    else:
        refused = too_large(model, EngineConfig(**base, num_blocks=2 * free // per_block))
    refused.update(free_bytes=free, seconds=time.perf_counter() - t0)
    report = {
        "environment": bm.environment(devices, ["benchmarks/probes/engine_memory_probe.py"]),
        "config": {"model": args.model, "layers": config.num_layers, **base},
        "engines": engines,
        "too_large": refused,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# Engines in a row ({args.model}, {report['environment']['device_kind']})",
        "",
        "| engine | free GiB | pool GiB | served tokens | s | same output |",
        "|---|---|---|---|---|---|",
        *(
            f"| {i} | {e['free_bytes'] / 2**30:.1f} | {e['pool_bytes'] / 2**30:.1f} | "
            f"{e['tokens']} | {e['seconds']:.1f} | {e['same_as_first']} |"
            for i, e in enumerate(engines)
        ),
        "",
        f"Pool of twice the free memory: refused={refused['refused']} in "
        f"{refused['seconds']:.2f} s.",
    ]
    (args.out / "engine_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = (
        refused["refused"] and refused["seconds"] <= 10 and all(e["same_as_first"] for e in engines)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
