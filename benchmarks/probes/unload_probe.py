"""Probe (2+ GPUs, one process): does freeing a jitted function while fused calls are in flight
hold back a GPU's launch until the spinning peer's wait expires?

Each round dispatches a chain of fused calls through a jitted function that is dropped at once
(XLA frees its executable, and unloads its CUDA modules, when the chain's last call ends), then
a run of single fused calls behind it, and waits. With ``--keep`` the chains' functions stay
alive instead. The communicator's wait bound is ``--bound`` seconds, so a held-back launch
shows as a round that fails with the "never started" report (which counts the launches the
host issued to each rank) instead of a hang. Run, on a machine of 2 or more GPUs:
``python3 -P benchmarks/probes/unload_probe.py --rounds 50`` and again with ``--keep``
(ffi/README.md, "One process, several GPUs").
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_tokenweave.kernel import _ffi, ops
from jax_tokenweave.kernel.comm import CommSettings, Communicator, reset_communicators


def _jit(mesh: Mesh, fn):
    return jax.jit(
        jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=(P("tp"), P("tp"), P()),
            out_specs=(P("tp"), P("tp")),
            check_vma=False,  # the fused call's outputs carry no varying-axis type
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--chain", type=int, default=200, help="fused calls in each dropped chain")
    ap.add_argument("--singles", type=int, default=50, help="single calls behind each chain")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--bound", type=float, default=2.0, help="the wait bound, seconds")
    ap.add_argument("--keep", action="store_true", help="keep every chain's function alive")
    args = ap.parse_args()
    if len(jax.devices()) < 2:
        raise SystemExit(f"needs 2 GPUs in this process, have {jax.devices()}")
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    if why := _ffi.unavailable_reason(mesh, "tp", jnp.bfloat16, (args.tokens, 8192)):
        raise SystemExit(f"the fused kernel cannot run here: {why}")
    settings = CommSettings(timeout_s=args.bound)
    rng = np.random.default_rng(0)
    h, rows = 8192, ops.rows_per_rank(args.tokens, 2)
    part = jnp.asarray(rng.standard_normal((2 * args.tokens, h)) * 0.01, jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((2 * rows, h)), jnp.bfloat16)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(h), jnp.bfloat16)
    kept, failures = [], []
    comm = Communicator(mesh, "tp", settings)

    def call(p, r, w):
        return _ffi.allreduce_rmsnorm(p, r, w, axis_name="tp", comm=comm)

    single = _jit(mesh, call)
    for k in range(args.rounds):

        def chain(p, r, w):
            return jax.lax.fori_loop(0, args.chain, lambda _, c: call(p, c[1], w), (p, r))

        f = _jit(mesh, chain)
        out = f(part, res, w)
        if args.keep:
            kept.append(f)
        del f  # (without --keep: freed when the chain's last call ends)
        t0 = time.perf_counter()
        try:
            for _ in range(args.singles):
                out = single(part, out[1], w)
            jax.block_until_ready(out)
            comm.check()
        except Exception as err:  # a held-back launch: record it, start over
            failures.append((k, time.perf_counter() - t0, str(err)))
            print(f"round {k}: {failures[-1][2]}")
            reset_communicators()
            comm = Communicator(mesh, "tp", settings)
            single = _jit(mesh, call)
    print(f"{len(failures)} of {args.rounds} rounds held back (keep={args.keep})")


if __name__ == "__main__":
    main()
