"""Probe (GPU): the power each part of a batch-256 decode step draws on its own.

The batch-256 decode step of Llama-3-8B shapes holds an H200 at its 700 W limit, and the SM
clock drops (``benchmarks/gpu_clocks.py``). Whether a leaner attention kernel could give the
GEMMs their clock back depends on where the watts go. This runs, each for ``--seconds`` in a
jitted loop, and samples the SM clock and power while it runs:

- ``read``: a sum over a bf16 array of ``--gib`` GiB (HBM read only, little arithmetic);
- ``copy``: the same array scaled in place (read and write);
- ``attention``: the engine's paged decode attention, 256 rows x ``--context`` keys (Hq 32,
  KVH 8, D 128, page 16, blocks in random order), each call's output the next call's query;
- ``gemm``: the step's MLP GEMMs at M = 256 (gate/up 4096 x 28672, down 14336 x 4096).

Per loop: its rate (GB/s of HBM traffic or TFLOP/s), the power and clock (median of samples),
and joules per GB or per TFLOP. Run: ``python3 -P benchmarks/probes/power_probe.py``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_tokenweave.harness import benchmarking as bm

BENCH = Path(__file__).resolve().parents[1]
_gpu_clocks = bm.sibling_module(str(BENCH / "gpu_clocks.py"), "gpu_clocks")
# the step's shapes (ROWS, KVH, D, HIDDEN, FFN), paged_decode and mlp
shapes = bm.sibling_module(
    str(BENCH / "probes" / "attention_interleave_probe.py"), "attention_interleave_probe"
)
INNER = 8  # iterations per jitted call
QUEUED = 8  # jitted calls in flight before the host waits


def _read_loop(gib: float) -> tuple[Callable[[], Any], float, str]:
    n = int(gib * 2**30) // 2
    x = jnp.ones((n,), jnp.bfloat16)

    @jax.jit
    def run(x: Any) -> Any:
        def body(i: Any, acc: Any) -> Any:
            return acc + jnp.sum(x.astype(jnp.float32) * (i + 1).astype(jnp.float32))

        return jax.lax.fori_loop(0, INNER, body, jnp.float32(0))

    return (lambda: run(x)), INNER * 2.0 * n / 1e9, "GB"


def _copy_loop(gib: float) -> tuple[Callable[[], Any], float, str]:
    n = int(gib * 2**30) // 2
    state = {"x": jnp.ones((n,), jnp.bfloat16)}
    run = jax.jit(
        lambda x: jax.lax.fori_loop(0, INNER, lambda i, y: y * jnp.bfloat16(-1.0), x),
        donate_argnums=0,
    )

    def step() -> Any:
        state["x"] = run(state["x"])
        return state["x"]

    return step, INNER * 4.0 * n / 1e9, "GB"


def _attention_loop(context: int, seed: int) -> tuple[Callable[[], Any], float, str]:
    attend, q, k, v = shapes.paged_decode(context, np.random.default_rng(seed))
    state = {"q": q, "k": k, "v": v}
    loop = lambda q, k, v: jax.lax.fori_loop(0, INNER, lambda i, c: attend(*c), (q, k, v))
    run = jax.jit(loop, donate_argnums=(1, 2))

    def step() -> Any:
        state["q"], state["k"], state["v"] = run(state["q"], state["k"], state["v"])
        return state["q"]

    kv_bytes = 2.0 * shapes.ROWS * context * shapes.KVH * shapes.D * 2
    return step, INNER * kv_bytes / 1e9, "GB"


def _gemm_loop(seed: int) -> tuple[Callable[[], Any], float, str]:
    rng = np.random.default_rng(seed)
    bf = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, jnp.bfloat16)
    rows, hidden, ffn = shapes.ROWS, shapes.HIDDEN, shapes.FFN
    x, w_up, w_down = bf(rows, hidden) * 50, bf(hidden, 2 * ffn), bf(ffn, hidden)

    @jax.jit
    def run(x: Any, w_up: Any, w_down: Any) -> Any:
        return jax.lax.fori_loop(0, INNER, lambda i, h: shapes.mlp(h, w_up, w_down), x)

    flops = 2.0 * rows * hidden * (2 * ffn) + 2.0 * rows * ffn * hidden
    return (lambda: run(x, w_up, w_down)), INNER * flops / 1e12, "TFLOP"


def measure(step: Callable[[], Any], work: float, unit: str, seconds: float) -> dict[str, Any]:
    """Rate of ``step`` (``work`` units per call) and the GPU's clock and power meanwhile. Calls
    are dispatched ``QUEUED`` at a time before the host waits, so the GPU never idles."""
    for _ in range(2):
        jax.block_until_ready(step())

    def queued() -> None:
        for _ in range(QUEUED):
            out = step()  # a donated loop's earlier outputs are gone: wait on the last
        jax.block_until_ready(out)

    wall, clocks = _gpu_clocks.sampled_loop(queued, seconds, calls_per_step=QUEUED)
    rate = work / wall
    found: dict[str, Any] = {"unit": unit, "per_s": rate, "ms_per_call": wall * 1e3}
    found["gpu_clocks"] = clocks
    if clocks.get("status") == "ok":
        found[f"joules_per_{unit}"] = clocks["power_w_p50"] / rate
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loops", nargs="+", default=["read", "copy", "attention", "gemm"])
    ap.add_argument("--gib", type=float, default=2.0, help="array size of read and copy")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time())
    makers = {
        "read": lambda: _read_loop(args.gib),
        "copy": lambda: _copy_loop(args.gib),
        "attention": lambda: _attention_loop(args.context, seed),
        "gemm": lambda: _gemm_loop(seed),
    }
    result: dict[str, Any] = {"seed": seed, "device": str(jax.devices()[0]), "loops": {}}
    for name in args.loops:
        found = measure(*makers[name](), args.seconds)
        result["loops"][name] = found
        print(name, json.dumps(found), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
