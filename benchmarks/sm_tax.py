"""SM tax of the fused kernel: how much slower the other half's GEMMs run while the kernel runs
beside them on the side stream (start/done), per variant and CTA count, against XLA's
asynchronous reduce-scatter + all-gather beside the same GEMMs.

The GEMM block is the MLP of one token half: [M, H] x [H, F] -> [M, F] x [F, H], twice. The
reduced tensor is the other half's [M, H] partial. Reported per mode: wall time of the jitted
step (median), device time of the GEMM kernels alone (profiled; the tax), and of the fused
kernel.

  python benchmarks/sm_tax.py --tokens 8192 --ctas 8 16 32 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.kernel import _ffi, ops

profile = bm.sibling_module(__file__, "profile_kernels").profile  # found under python -P too


def _step(mesh: Mesh, mode: str, algo: str, ctas: int):
    def gemms(x, w1, w2):
        for _ in range(2):
            x = (x @ w1) @ w2
        return x

    def body(x, w1, w2, p, r, nw):
        if mode == "alone":
            return gemms(x, w1, w2), r
        if mode == "xla":  # XLA's collectives, scheduled by XLA beside the GEMMs
            _, res = ops.allreduce_rmsnorm(p, r, nw, axis_name="tp", impl="xla_rsag")
            return gemms(x, w1, w2), res
        pend = _ffi.allreduce_rmsnorm_start(
            p, r, nw, axis_name="tp", mesh=mesh, slot=0, num_ctas=ctas, algo=algo
        )
        pend, x = jax.lax.optimization_barrier((pend, x))
        y = gemms(x, w1, w2)
        pend, y = jax.lax.optimization_barrier((pend, y))
        _, res = _ffi.allreduce_rmsnorm_done(pend, axis_name="tp", mesh=mesh, slot=0)
        return y, res

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), P(None, "tp"), P("tp"), P("tp"), P("tp"), P()),
            out_specs=(P(), P("tp")),
            check_vma=False,
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--tp", type=int, default=len(jax.devices("gpu")), help="GPUs in the axis")
    ap.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[4096, 8192, 16384],
        help="batch tokens (each half gets half)",
    )
    ap.add_argument("--hidden", type=int, default=8192, help="hidden size H")
    ap.add_argument("--ffn", type=int, default=28672, help="FFN size F (sharded over tp)")
    ap.add_argument("--algos", nargs="+", default=["direct"], help="fused kernel variants")
    ap.add_argument("--ctas", type=int, nargs="+", default=[8, 16, 32], help="CTA counts")
    ap.add_argument("--reps", type=int, default=10, help="timed runs per mode")
    ap.add_argument("--out", type=Path, default=None, help="folder for JSON + markdown")
    args = ap.parse_args(argv)

    n, h = args.tp, args.hidden
    mesh = Mesh(np.array(jax.devices("gpu")[:n]), ("tp",))
    rng = np.random.default_rng(0)
    modes = [("alone", "", 0), ("xla", "", 0)] + [
        ("ffi", a, c) for a in args.algos for c in args.ctas
    ]
    rows, lines = (
        [],
        [
            "| T | mode | step ms | GEMM device ms | tax | kernel device ms |",
            "|---|---|---|---|---|---|",
        ],
    )
    for tokens in args.tokens:
        m = tokens // 2
        bf = jnp.bfloat16
        x = jnp.asarray(rng.standard_normal((m, h)) / 8, bf)
        w1 = jnp.asarray(rng.standard_normal((h, args.ffn)) / 100, bf)
        w2 = jnp.asarray(rng.standard_normal((args.ffn, h)) / 100, bf)
        p = jnp.asarray(rng.standard_normal((n * m, h)), bf)
        r = jnp.asarray(rng.standard_normal((n * ops.rows_per_rank(m, n), h)), bf)
        nw = jnp.ones((h,), jnp.float32)
        base = None
        for mode, algo, ctas in modes:
            fn = _step(mesh, mode, algo, ctas)
            ins = (x, w1, w2, p, r, nw)
            jax.block_until_ready(fn(*ins))
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*ins))
                times.append(time.perf_counter() - t0)
            per = profile(fn, ins, args.reps).kernels
            gemm = kernel = 0.0
            for (dev, name), us in per.items():
                if dev != mesh.devices.flat[0].local_hardware_id:
                    continue
                if "tokenweave" in name:
                    kernel += us / args.reps / 1e3
                elif "gemm" in name.lower() or "cutlass" in name.lower() or "nvjet" in name:
                    gemm += us / args.reps / 1e3
            base = gemm if mode == "alone" else base
            label = mode if mode != "ffi" else f"ffi:{algo}:{ctas}"
            tax = gemm / base - 1 if base else float("nan")
            rows.append(
                dict(
                    tokens=tokens,
                    mode=label,
                    step_ms=statistics.median(times) * 1e3,
                    gemm_device_ms=gemm,
                    tax=tax,
                    kernel_device_ms=kernel,
                )
            )
            lines.append(
                f"| {tokens} | {label} | {rows[-1]['step_ms']:.3f} | {gemm:.3f} | "
                f"{tax:+.1%} | {kernel:.3f} |"
            )
            print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = dict(
            command=" ".join(["benchmarks/sm_tax.py", *(argv or sys.argv[1:])]),
            date=time.strftime("%Y-%m-%d"),
            tp=n,
            devices=[str(d) for d in mesh.devices.flat],
            method="GEMM device time summed from torch.profiler on the first GPU, "
            "median wall time of the jitted step",
        )
        (args.out / "sm_tax.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        (args.out / "sm_tax.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
