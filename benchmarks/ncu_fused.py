"""Runs the fused kernel alone, for Nsight Compute: a jitted chain of fused calls on one GPU
(N = 1: the kernel's fixed cost, with nothing to communicate) or on --tp GPUs, at one size;
`--impl xla` runs XLA's chain of the same calls instead, for the same report.
No torch profiler here (it would hold CUPTI, which ncu needs). gpu_session.sh's `ncu` stage
runs it as

  ncu --set full --import-source yes --kernel-name regex:OneShot|Fused \\
      --launch-skip 8 --launch-count 1 -o REPORT python3 benchmarks/ncu_fused.py --tokens 16

and exports the report's details and per-line source view to CSV.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_tokenweave.kernel._util import ceil_div

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_kernels import chain


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=1, help="GPUs in the axis")
    ap.add_argument("--tokens", type=int, default=16, help="tokens T")
    ap.add_argument("--hidden", type=int, default=8192, help="hidden size H (bf16)")
    ap.add_argument("--impl", choices=("ffi", "xla"), default="ffi", help="whose calls")
    ap.add_argument("--weight-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--algo", default="auto", help="fused kernel variant")
    ap.add_argument("--ctas", type=int, default=0, help="CTAs (0: the policy table's)")
    ap.add_argument("--calls", type=int, default=4, help="calls per jitted chain")
    ap.add_argument("--runs", type=int, default=4, help="chain runs")
    args = ap.parse_args(argv)
    mesh = Mesh(np.array(jax.devices("gpu")[: args.tp]), ("tp",))
    rng = np.random.default_rng(0)
    n, t, h = args.tp, args.tokens, args.hidden
    part = jnp.asarray(rng.standard_normal((n * t, h)), jnp.bfloat16)
    rows = ceil_div(t, n) if args.impl == "ffi" else t  # the residual: token-sharded or whole
    res = jnp.asarray(rng.standard_normal((n * rows, h)), jnp.bfloat16)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(h), jnp.dtype(args.weight_dtype))
    fn = chain(mesh, args.impl, args.calls, args.algo, args.ctas or None)
    for _ in range(args.runs):
        out = fn(part, res, w)
    jax.block_until_ready(out)
    print("ran", args.runs * args.calls, args.impl, "calls at T =", t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
