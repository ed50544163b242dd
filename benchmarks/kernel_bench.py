"""Fused AllReduce + residual + RMSNorm: ``ffi`` vs ``xla`` (psum + norm) vs ``xla_rsag``.

Method: for each configuration one jitted ``shard_map`` function runs the op K times in a
fully unrolled ``lax.fori_loop`` (no per-iteration host sync; both outputs feed the next call,
``normed`` as its ``partial`` and ``residual_out`` as its residual, through an optimization
barrier, so no call can be skipped, hoisted out of the loop or merged with another by XLA: at
N = 1, where psum is a no-op, XLA otherwise fuses several calls' add + norm into one kernel);
it is timed with ``block_until_ready`` over R repetitions after a warm-up, and the median time
divided by K is reported as the device time per call (one dispatch per K calls, so dispatch
is amortised; the same method for every impl).
Each ffi configuration (variant and CTA count) is checked against ``xla_rsag`` on fresh random
inputs before timing. With ``--device-time`` each configuration is also profiled
(torch.profiler: the GPU's busy time over the chain, the union of its kernels' intervals, per
GPU, median over GPUs; see ``profile_kernels.py``), and bandwidth uses that time. Bandwidth:
``busbw = 2 (N-1)/N * T*H*bytes / time`` (the all-reduce convention), and
``algbw = T*H*bytes / time``. ``ce`` rows (copy engines) keep wall time (the profiler does
not see stream waits) and report their floor: the copies they need at the copy-engine
bandwidth measured in the same run (``copy_floor_us``, ``over_copy_floor``).
``--write-policy PATH`` writes the size table ``auto`` reads
(``jax_tokenweave/kernel/policy.json`` format) from the fastest ffi variant and CTA count at each
measured size, keeping the TP degrees it did not measure (``policy_table.py`` does the same from
saved results).

    python benchmarks/kernel_bench.py --out benchmarks/results/kernel --tokens 1 128 4096

One process per GPU works too (``python -m jax_tokenweave.launch -n 2 -- python
benchmarks/kernel_bench.py ...``): every process builds the same inputs (``--seed``) and times
its own GPU; process 0 reports.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.kernel import _ffi, ops
from jax_tokenweave.kernel.comm import get_communicator

FUSED = ("ffi", "ffi_replicated")  # the fused kernel's impls: token-sharded, replicated residual
_table = bm.sibling_module(__file__, "policy_table")  # time_of, ran, write (found under -P)


# Every jitted chain lives until the process ends: freeing one unloads its CUDA modules, which
# in one process driving several GPUs can hold back a launch while a fused kernel spins for it
# (ffi/README.md, "One process, several GPUs").
@functools.cache  # one jitted function per configuration, kept for the whole run
def _ctas(text: str) -> int | None:
    """A ``--ctas`` value: a positive count, or ``policy`` (None: the policy table's)."""
    if text == "policy":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a CTA count is a positive integer or 'policy': {text!r}")
    return int(text)


def _time(f, args, reps):
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024, 4096, 16384])
    ap.add_argument("--hidden", type=int, nargs="+", default=[8192, 5120, 4096])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument(
        "--ctas",
        type=_ctas,
        nargs="+",
        default=[2, 4, 8, 16, 32],
        help="CTA counts of the ffi rows; 'policy': the count auto takes (policy.json)",
    )
    ap.add_argument("--algos", nargs="+", default=["auto"])
    ap.add_argument(
        "--impls",
        nargs="+",
        default=["ffi", "xla", "xla_rsag"],
        choices=[*FUSED, "xla", "xla_rsag"],
        help="ffi_replicated: the fused kernel with the residual replicated (decode sizes)",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--time-budget",
        type=float,
        default=float("inf"),
        metavar="SECONDS",
        help="start no new measurement after this many seconds",
    )
    ap.add_argument(
        "--device-time",
        action="store_true",
        help="also profile device time per call (torch.profiler)",
    )
    ap.add_argument(
        "--write-policy",
        default=None,
        metavar="PATH",
        help="write the size policy table from the fastest ffi rows",
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="input seed (default: fresh, the first process's when there are several)",
    )
    args = ap.parse_args()
    _, gpus = bm.start_devices()  # joins the other processes when started by the launcher
    lead = bm.is_lead()
    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    dtype = jnp.dtype(args.dtype)
    seed = args.seed if args.seed is not None else bm.resolve_seed()
    rng = np.random.default_rng(seed)
    configs = []
    for tp in args.tp:
        if tp > len(gpus):
            continue
        for h in args.hidden:
            for t in args.tokens:
                for impl in args.impls:
                    if impl in FUSED:
                        configs += [(tp, h, t, impl, c, a) for c in args.ctas for a in args.algos]
                    else:
                        configs.append((tp, h, t, impl, None, None))
    rows, checked = [], set()
    profiling = bm.sibling_module(__file__, "profile_kernels")  # found under python -P too
    meta = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=gpus[0].device_kind,
        n_devices=len(gpus),
        jax=jax.__version__,
        processes=jax.process_count(),
        seed=seed,
        commit=bm.git_commit() or "unknown",
        method=__doc__.split("\n\n")[1],
        argv=" ".join(sys.argv),
    )
    for tp, h, t, impl, ctas, algo in tqdm(configs, desc="kernel_bench", disable=not lead):
        if time.perf_counter() - start > args.time_budget:
            tqdm.write(f"time budget of {args.time_budget:.0f} s spent: stopping")
            break
        mesh = Mesh(np.array(gpus[:tp]), ("tp",))
        why = None
        if impl in FUSED:  # (e.g. more CTAs than the asked variant's grid holds)
            why = _fused_reason(mesh, impl, dtype, (t, h), ctas, algo)
        if why is not None:
            tqdm.write(f"skip {impl} tp={tp} H={h} T={t} CTAs={ctas} algo={algo}: {why}")
            continue
        q = ops.rows_per_rank(t, tp)
        res_rows = t if impl in ("xla", "ffi_replicated") else q
        part = bm.global_array(
            mesh, (rng.standard_normal((tp * t, h)) * 0.01).astype(dtype), P("tp")
        )
        res = bm.global_array(mesh, rng.standard_normal((tp * res_rows, h)).astype(dtype), P("tp"))
        w = bm.global_array(mesh, (1 + 0.1 * rng.standard_normal(h)).astype(dtype), P())
        if impl in FUSED and (impl, tp, h, t, algo, ctas) not in checked:  # vs XLA's, same layout
            got = profiling.chain(mesh, impl, 1, algo, ctas)(part, res, w)
            ref = "xla" if impl == "ffi_replicated" else "xla_rsag"
            want = profiling.chain(mesh, ref, 1, None, None)(part, res, w)
            for g, x in zip(got, want, strict=True):
                g, x = bm.local_data(g), bm.local_data(x)
                err = np.linalg.norm(g - x) / np.linalg.norm(x)
                assert err < 2e-2, (
                    f"{impl} mismatch tp={tp} H={h} T={t} algo={algo} CTAs={ctas}: rel err {err}"
                )
            checked.add((impl, tp, h, t, algo, ctas))
        nbytes = t * h * dtype.itemsize
        iters = 50 if nbytes <= 4 << 20 else 10
        fn = profiling.chain(mesh, impl, iters, algo, ctas)
        sec = _time(fn, (part, res, w), args.reps) / iters
        row = dict(
            tp=tp,
            hidden=h,
            tokens=t,
            impl=impl,
            num_ctas=ctas,
            algo=algo,
            dtype=str(dtype),
            us=sec * 1e6,
        )
        if impl in FUSED:  # what ran: auto's variant, the policy's count
            row["ran_algo"], row["ran_ctas"] = _fused_choice(mesh, impl, dtype, (t, h), ctas, algo)
        if row.get("ran_algo") == "ce":  # its floor: the copies it needs at the engines' rate
            row.update(_copy_floor(mesh, q * h * dtype.itemsize, sec))
        if args.device_time and row.get("ran_algo") != "ce":
            row["device_us"] = profiling.device_us_per_call(fn, (part, res, w), args.reps, iters)
            sec = row["device_us"] / 1e6
        row.update(algbw_gbs=nbytes / sec / 1e9, busbw_gbs=2 * (tp - 1) / tp * nbytes / sec / 1e9)
        rows.append(row)
        if not lead:
            continue
        tqdm.write(json.dumps(rows[-1]))
        with open(os.path.join(args.out, "kernel_bench.json"), "w") as f:  # after every row
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if not lead:
        return
    _markdown(args.out, meta, rows)
    _plot(args.out, rows)
    if args.write_policy:
        _table.write(rows, meta, args.write_policy)
        print(f"policy table written to {args.write_policy}")


@functools.cache
def _copy_bandwidth(ordinals: tuple[int, ...], nbytes: int) -> float:
    """GB/s of each GPU's copy-engine copy of ``nbytes`` into the next one, all at once."""
    from jax_tokenweave.kernel import _extension

    return _extension.get().copy_bandwidth(list(ordinals), nbytes, 10)


def _copy_floor(mesh, slice_bytes: int, sec: float) -> dict:
    """A ``ce`` row's floor: its reduce-scatter and all-gather each bring (N-1) slices of
    ``slice_bytes`` into every GPU, at the copy bandwidth measured now for one slice. The
    profiler does not see stream waits, so these rows keep wall time only."""
    n = mesh.devices.size
    ordinals = tuple(d.local_hardware_id for d in mesh.devices.flat)
    gbs = _copy_bandwidth(ordinals, slice_bytes)
    floor = 2 * (n - 1) * slice_bytes / (gbs * 1e9)
    return dict(copy_gbs=gbs, copy_floor_us=floor * 1e6, over_copy_floor=sec / floor)


def _fused_choice(mesh, impl, dtype, shape, ctas, algo) -> tuple[str, int]:
    """(variant, CTAs) that a fused call of ``impl`` runs for these arguments."""
    comm = get_communicator(mesh, "tp")
    if impl == "ffi_replicated":
        return _ffi._replicated_choice(comm, jax.ShapeDtypeStruct(shape, dtype), algo, ctas)
    return comm.choose(dtype, shape, algo=algo, num_ctas=ctas)


def _fused_reason(mesh, impl, dtype, shape, ctas, algo) -> str | None:
    """None where the fused call of ``impl`` can run these arguments, else why not."""
    if impl == "ffi_replicated":
        return _ffi.replicated_reason(mesh, "tp", dtype, shape, num_ctas=ctas, algo=algo)
    return _ffi.unavailable_reason(mesh, "tp", dtype, shape, num_ctas=ctas, algo=algo)


def _label(r):
    """impl, with the kernel variant for ffi rows (``ffi:direct``)."""
    return f"{r['impl']}:{r['algo']}" if r["impl"] in FUSED and r["algo"] else r["impl"]


def _best_ffi(rows):
    """Per (TP, H, T, impl label): the row of the fastest CTA count."""
    best = {}
    for r in rows:
        key = (r["tp"], r["hidden"], r["tokens"], _label(r))
        if key not in best or _table.time_of(r) < _table.time_of(best[key]):
            best[key] = r
    return best


def _markdown(out, meta, rows):
    lines = [
        f"# kernel_bench ({meta['device']} x{meta['n_devices']}, {meta['date']})",
        "",
        f"commit {meta['commit']}; jax {meta['jax']}",
        "",
        meta["method"],
        "",
        "| TP | H | T | impl | CTAs | algo | us/call (wall) | us/call (device) | busbw GB/s "
        "| copy floor us (x) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dev = f"{r['device_us']:.1f}" if "device_us" in r else "-"
        floor = f"{r['copy_floor_us']:.1f} ({r['over_copy_floor']:.2f}x)" if "copy_gbs" in r else ""
        ctas, algo = _shown(r)
        lines.append(
            f"| {r['tp']} | {r['hidden']} | {r['tokens']} | {r['impl']} | {ctas} | {algo} | "
            f"{r['us']:.1f} | {dev} | {r['busbw_gbs']:.1f} | {floor} |"
        )
    lines += [
        "",
        "Best per impl:",
        "",
        "| TP | H | T | impl | us/call | CTAs |",
        "|---|---|---|---|---|---|",
    ]
    for (tp, h, t, impl), r in sorted(_best_ffi(rows).items()):
        lines.append(f"| {tp} | {h} | {t} | {impl} | {_table.time_of(r):.1f} | {_shown(r)[0]} |")
    with open(os.path.join(out, "kernel_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-(len(_best_ffi(rows)) + 2) :]))


def _shown(r) -> tuple[str, str]:
    """The CTAs and algo cells of a row: as asked, with what ran where it differs
    (``policy (64)``, ``auto (one_shot)``)."""
    if r["impl"] not in FUSED:
        return "", ""
    ran_algo, ran_ctas = _table.ran(r)
    ctas = "policy" if r["num_ctas"] is None else str(r["num_ctas"])
    ctas += f" ({ran_ctas})" if str(ran_ctas) != ctas else ""
    algo = r["algo"] + (f" ({ran_algo})" if ran_algo != r["algo"] else "")
    return ctas, algo


def _plot(out, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = _best_ffi(rows)
    keys = sorted({(tp, h) for tp, h, _, _ in best})
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, (tp, h) in zip(axes[0], keys, strict=True):
        for impl in sorted({k[3] for k in best}):
            pts = sorted(
                (t, _table.time_of(r))
                for (a, b, t, i), r in best.items()
                if (a, b, i) == (tp, h, impl)
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=impl)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="tokens",
            ylabel="us per call",
            title=f"TP={tp} H={h}",
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "kernel_bench.png"), dpi=100)


if __name__ == "__main__":
    main()
