"""Device time per all-reduce + residual + RMSNorm call, profiled (torch.profiler sees every
CUDA kernel of the process, JAX's included): XLA's psum + add/norm fusions against the fused
kernel, at decode sizes, inside one jitted chain of calls (outputs feed the next call, through
an optimization barrier, so XLA cannot merge calls).

  python benchmarks/profile_kernels.py --tp 2 --tokens 1 16 64 256 --out DIR

Reports, per mode and size, the summed device time of every kernel in the chain divided by the
number of calls (per GPU, median over GPUs), and the kernels that make it up.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.kernel import ops

_step_profile = bm.sibling_module(__file__, "step_profile")  # found under -P


def chain(mesh: Mesh, impl: str, calls: int, algo: str | None, num_ctas: int | None):
    """``calls`` calls of ``impl`` in one jitted program over ``mesh`` (axis ``tp``), each
    call's outputs the next one's inputs: ``(partial [tp*T, H], residual [tp*rows, H], weight
    [H]) -> (normed, residual)``, both ``P("tp")``; rows: T for ``xla`` and ``ffi_replicated``,
    else ceil(T / tp). Shared by kernel_bench and ncu_fused."""

    def body(p, r, w):
        x, res = p, r
        for _ in range(calls):  # each call's normed output is the next call's partial
            if impl in ("ffi", "ffi_replicated"):
                from jax_tokenweave.kernel import _ffi

                x, res = _ffi.allreduce_rmsnorm(
                    x,
                    res,
                    w,
                    axis_name="tp",
                    mesh=mesh,
                    algo=algo,
                    num_ctas=num_ctas,
                    residual_replicated=impl == "ffi_replicated",
                )
            else:
                x, res = ops.allreduce_rmsnorm(x, res, w, axis_name="tp", impl=impl)
            # In a model GEMMs sit between calls: without this, XLA at N = 1 (psum a no-op)
            # fuses several calls' add + norm into one kernel and the per-call time shrinks.
            x, res = jax.lax.optimization_barrier((x, res))
        return x, res

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("tp"), P("tp"), P()),
            out_specs=(P("tp"), P("tp")),
            check_vma=False,
        )
    )


class Profile(NamedTuple):
    """What the profiler saw in ``iters`` runs of a function."""

    kernels: dict[tuple[int, str], float]  # (device, kernel name) -> us, summed over launches
    busy: dict[int, float]  # device -> us: the union of its kernels' intervals


def profile(fn, args, iters: int) -> Profile:
    """Profiles ``iters`` runs of fn after two warm runs (``step_profile.record_kernels``). In
    ``busy`` kernels that overlap, as programmatic launches do, count once."""
    _, kernels = _step_profile.record_kernels(lambda: fn(*args), iters, warm=2)
    out: dict[tuple[int, str], float] = collections.defaultdict(float)
    spans: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    for k in kernels:
        out[(k.device, k.name)] += k.device_us
        spans[k.device].append((k.start, k.end))
    return Profile(dict(out), {dev: _step_profile.busy_us(s) for dev, s in spans.items()})


def device_us_per_call(fn, args, iters: int, calls_per_run: int) -> float:
    """Device time of one call: each GPU's busy time over ``iters`` runs of ``fn``
    (``calls_per_run`` calls each; the union of its kernels' intervals, so kernels that
    overlap, as programmatic launches do, count once), median over GPUs."""
    per_dev = [us / (iters * calls_per_run) for us in profile(fn, args, iters).busy.values()]
    return statistics.median(per_dev) if per_dev else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--tp", type=int, default=len(jax.devices("gpu")), help="GPUs in the axis")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256], help="tokens T")
    ap.add_argument("--hidden", type=int, default=8192, help="hidden size H (bf16)")
    ap.add_argument(
        "--weight-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="the RMSNorm weight's dtype, the same for every mode (a bf16 model's is bf16)",
    )
    ap.add_argument("--algo", default="auto", help="fused kernel variant")
    ap.add_argument(
        "--ctas",
        type=int,
        nargs="+",
        default=[0],
        help="fused kernel CTA counts to profile (0: the policy table's)",
    )
    ap.add_argument("--calls", type=int, default=16, help="calls per jitted chain")
    ap.add_argument("--iters", type=int, default=20, help="profiled chain runs")
    ap.add_argument("--out", type=Path, default=None, help="folder for JSON + markdown")
    args = ap.parse_args(argv)

    mesh = Mesh(np.array(jax.devices("gpu")[: args.tp]), ("tp",))
    rng = np.random.default_rng(0)
    rows = []
    lines = [
        "| T | mode | us/call (device) | us/call (busy) | kernels (us/call) |",
        "|---|---|---|---|---|",
    ]
    for tokens in args.tokens:
        n, h = args.tp, args.hidden
        part = jnp.asarray(rng.standard_normal((n * tokens, h)), jnp.bfloat16)
        w = jnp.asarray(1 + 0.1 * rng.standard_normal(h), jnp.dtype(args.weight_dtype))
        for impl, ctas in [("xla", 0)] + [("ffi", c) for c in args.ctas]:
            rows_res = tokens if impl == "xla" else ops.rows_per_rank(tokens, n)
            res = jnp.asarray(rng.standard_normal((n * rows_res, h)), jnp.bfloat16)
            fn = chain(mesh, impl, args.calls, args.algo, ctas or None)
            per, busy = profile(fn, (part, res, w), args.iters)
            calls = args.iters * args.calls
            by_dev = collections.defaultdict(float)
            by_name = collections.defaultdict(float)
            for (dev, name), us in per.items():
                by_dev[dev] += us / calls
                by_name[name] += us / calls / max(1, n)
            total = statistics.median(by_dev.values()) if by_dev else float("nan")
            busy_us = statistics.median(busy.values()) / calls if busy else float("nan")
            top = sorted(by_name.items(), key=lambda kv: -kv[1])[:4]
            mode = impl if impl == "xla" else f"ffi:{ctas or 'policy'}"
            rows.append(
                dict(
                    tokens=tokens,
                    mode=mode,
                    us_per_call=total,
                    busy_us_per_call=busy_us,
                    kernels={k: round(v, 2) for k, v in top},
                )
            )
            lines.append(
                f"| {tokens} | {mode} | {total:.2f} | {busy_us:.2f} | "
                + "; ".join(f"{k[:40]} {v:.2f}" for k, v in top)
                + " |"
            )
            print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = dict(
            command=" ".join(["benchmarks/profile_kernels.py", *(argv or sys.argv[1:])]),
            date=time.strftime("%Y-%m-%d"),
            tp=args.tp,
            weight_dtype=args.weight_dtype,
            hidden=args.hidden,
            devices=[str(d) for d in mesh.devices.flat],
            method="torch.profiler device time of every kernel in a jitted chain of "
            "--calls calls, --iters runs after two warm runs; per GPU, median over GPUs; "
            "busy: the union of the kernels' intervals (overlapping kernels count once)",
        )
        (args.out / "profile_kernels.json").write_text(
            json.dumps(dict(meta=meta, rows=rows), indent=1)
        )
        (args.out / "profile_kernels.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
