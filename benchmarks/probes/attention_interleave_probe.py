"""Probe (GPU): is decode attention slower between GEMMs than back to back, and why?

In a batch-256 decode step of Llama-3-8B shapes the attention kernel takes 294-317 us a layer,
against 270 us in ``attention_bench.py`` where calls run back to back. This runs the same
attention call (256 rows x 1024 keys, Hq 32, KVH 8, D 128, page 16, bf16, blocks in random
order) in two jitted chains of ``--calls`` calls: ``attention`` (each call's output is the
next call's query) and ``mixed`` (an MLP of the model's shapes, M = 256, between the calls;
its output feeds the next query). Per chain: the attention kernel's profiled device time per
call (PyTorch's CUDA profiler), and the SM clock and power sampled by nvidia-smi while the chain
repeats for ``--seconds`` (``benchmarks/gpu_clocks.py``).
Run: ``python3 -P benchmarks/probes/attention_interleave_probe.py``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.serving.attention import attention_kernel

BENCH = Path(__file__).resolve().parents[1]
_gpu_clocks = bm.sibling_module(str(BENCH / "gpu_clocks.py"), "gpu_clocks")

ROWS, HQ, KVH, D, BS, HIDDEN, FFN = 256, 32, 8, 128, 16, 4096, 14336


def paged_decode(context: int, rng: np.random.Generator):
    """``attend(q, k, v) -> (out, k, v)``, the engine's paged decode attention over ``ROWS``
    rows of ``context`` keys (blocks in random order, caches aliased through), and fresh bf16
    ``q [ROWS, HQ, D]``, ``k``, ``v [blocks, BS, KVH, D]``."""
    width = -(-context // BS)
    num_blocks = ROWS * width + 7
    tables = rng.permutation(num_blocks)[: ROWS * width].reshape(ROWS, width).astype(np.int32)
    bf = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
    k, v = bf(num_blocks, BS, KVH, D), bf(num_blocks, BS, KVH, D)
    q = bf(ROWS, HQ, D)
    positions = jnp.full((ROWS,), context - 1, jnp.int32)
    tables = jnp.asarray(tables)

    def attend(q, k, v):
        return attention_kernel.paged_attention(
            q, k, v, tables, positions, tile=1, scale=D**-0.5, tight=True
        )

    return attend, q, k, v


def mlp(h, w_up, w_down):
    """The model's MLP on ``h [rows, HIDDEN]``: ``(silu(gate) * up) @ w_down``."""
    u = h @ w_up
    return (jax.nn.silu(u[:, :FFN]) * u[:, FFN:]) @ w_down


def _chains(context: int, calls: int, seed: int):
    rng = np.random.default_rng(seed)
    attend, q, k, v = paged_decode(context, rng)
    bf = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
    x = bf(ROWS, HIDDEN)
    w_up = bf(HIDDEN, 2 * FFN) * 0.02
    w_down = bf(FFN, HIDDEN) * 0.02

    def attention_only(q, k, v, x, w_up, w_down):
        for _ in range(calls):
            q, k, v = attend(q, k, v)
        return q

    def mixed(q, k, v, x, w_up, w_down):
        for _ in range(calls):
            q, k, v = attend(q, k, v)
            q = mlp(q.reshape(ROWS, HIDDEN) + x, w_up, w_down).reshape(ROWS, HQ, D)
        return q

    args = (q, k, v, x, w_up, w_down)
    return {"attention": (jax.jit(attention_only), args), "mixed": (jax.jit(mixed), args)}


def _kernel_us(fn, args, reps: int) -> dict[str, float]:
    """Kernel name -> median device us per launch over ``reps`` runs of ``fn`` (after one
    untimed run), from ``step_profile.profile_steps``."""
    jax.block_until_ready(fn(*args))
    step_profile = bm.sibling_module(str(BENCH / "step_profile.py"), "step_profile")
    prof = step_profile.profile_steps(
        lambda: jax.block_until_ready(fn(*args)), reps, host_profile=False
    )
    if prof["status"] != "ok":
        raise SystemExit(f"cannot profile: {prof['reason']}")
    return {k["name"][:60]: k["us_per_launch_min_p50_max"][1] for k in prof["kernels"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=16, help="attention calls per chain")
    ap.add_argument("--seconds", type=float, default=4.0, help="clock sampling per chain")
    ap.add_argument("--reps", type=int, default=3, help="profiled runs per chain")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time())
    result = {"context": args.context, "calls": args.calls, "seed": seed, "chains": {}}
    for name, (fn, fargs) in _chains(args.context, args.calls, seed).items():
        kernels = _kernel_us(fn, fargs, args.reps)
        attention = {k: us for k, us in kernels.items() if "Decode" in k}
        run_once = lambda fn=fn, fargs=fargs: jax.block_until_ready(fn(*fargs))
        seconds_per_run, clocks = _gpu_clocks.sampled_loop(run_once, args.seconds)
        wall_ms = seconds_per_run * 1e3
        result["chains"][name] = {
            "attention_us_per_call": attention,
            "wall_ms_per_run": wall_ms,
            "gpu_clocks": clocks,
            "top_kernels_us": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:6]),
        }
        print(name, json.dumps(result["chains"][name], indent=1), flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
