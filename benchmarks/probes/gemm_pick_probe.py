"""Probe (GPU): which GEMM kernels a decode step's projections get, and their device time.

A decode step's layers without attention (Llama-3-8B shapes: QKV 4096x6144, O 4096x4096,
gate/up 4096x28672, SiLU x up, down 14336x4096, add + RMSNorm), ``--layers`` of them with
weights of their own, then the lm_head (4096x128256), at ``--rows`` rows, bf16. Compiled by XLA
under ``--mode``'s options, or run in PyTorch (cuBLAS's own heuristic pick):

- ``split``: XLA's defaults; ``nosplit``: split-K off (the engine's decode steps of >= 64 rows);
- ``level0``: ``nosplit`` with autotuning off (cuBLAS's heuristic algorithm, Triton defaults);
- ``cublas``: ``nosplit`` with Triton GEMMs off (autotuning among cuBLAS's algorithms only);
- ``torch``: the same chain in PyTorch.

Prints the kernels with the most device time per step (PyTorch's profiler) and writes them as
JSON to ``--out``. Run each mode in processes of its own to see how XLA's pick varies between
compilations: ``python3 -P benchmarks/probes/gemm_pick_probe.py --mode nosplit --out x.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

H, F, QKV, VOCAB = 4096, 14336, 6144, 128256

MODES = {
    "split": {},
    "nosplit": {"xla_gpu_experimental_force_split_k": 1},
    "level0": {"xla_gpu_experimental_force_split_k": 1, "xla_gpu_autotune_level": 0},
    "cublas": {"xla_gpu_experimental_force_split_k": 1, "xla_gpu_enable_triton_gemm": False},
}


def _jax_step(rows: int, layers: int, options: dict[str, Any]) -> Any:
    import jax
    import jax.numpy as jnp

    def norm(x: Any) -> Any:
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)

    def chain(x: Any, weights: list[tuple[Any, ...]], lm_head: Any) -> Any:
        h = x
        for wqkv, wo, wgu, wd in weights:
            a = jnp.dot(norm(h), wqkv)[:, :H]  # stands in for attention's output
            h = h + jnp.dot(a, wo)
            gu = jnp.dot(norm(h), wgu)
            h = h + jnp.dot(jax.nn.silu(gu[:, :F]) * gu[:, F:], wd)
        return jnp.dot(norm(h), lm_head)

    key = iter(jax.random.split(jax.random.key(0), 4 * layers + 2))

    def rand(*shape: int) -> Any:
        return (jax.random.normal(next(key), shape, jnp.float32) / shape[0] ** 0.5).astype(
            jnp.bfloat16
        )

    weights = [(rand(H, QKV), rand(H, H), rand(H, 2 * F), rand(F, H)) for _ in range(layers)]
    lm_head, x = rand(H, VOCAB), rand(rows, H) * 64
    step = jax.jit(chain, compiler_options=options)
    step(x, weights, lm_head).block_until_ready()
    return lambda: step(x, weights, lm_head).block_until_ready()


def _torch_step(rows: int, layers: int) -> Any:
    import torch

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) / shape[0] ** 0.5

    def norm(x: Any) -> Any:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    weights = [(rand(H, QKV), rand(H, H), rand(H, 2 * F), rand(F, H)) for _ in range(layers)]
    lm_head, x = rand(H, VOCAB), rand(rows, H) * 64

    @torch.inference_mode()
    def step() -> None:
        h = x
        for wqkv, wo, wgu, wd in weights:
            h = h + (norm(h) @ wqkv)[:, :H] @ wo
            gu = norm(h) @ wgu
            h = h + (torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]) @ wd
        (norm(h) @ lm_head).sum().item()

    step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=[*MODES, "torch"], default="nosplit")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from jax_tokenweave.harness import benchmarking as bm

    bench = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    step_profile = bm.sibling_module(os.path.join(bench, "step_profile.py"), "step_profile")
    if args.mode == "torch":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        step = _torch_step(args.rows, args.layers)
    else:
        step = _jax_step(args.rows, args.layers, MODES[args.mode])
    for _ in range(3):
        step()
    prof = step_profile.profile_steps(step, args.steps, top=12, host_profile=False)
    if prof["status"] != "ok":
        raise SystemExit(f"== {args.mode}: {prof['reason']}")
    record = {"mode": args.mode, "rows": args.rows, "layers": args.layers, "profile": prof}
    print(f"== {args.mode}: rows {args.rows}, {args.layers} layers, busy {prof['busy_ms']:.3f} ms")
    for k in prof["kernels"]:
        print(f"{k['ms_per_step']:8.3f} ms {k['calls_per_step']:5.1f} x  {k['name'][:70]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
