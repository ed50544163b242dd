"""Fixed cost of each fused-kernel variant on ONE GPU, every rank of an N-rank group on it
(jax_tokenweave.kernel.loopback): device time of one call, from timed replays of a CUDA graph of
calls. Peer traffic is local memory here, so this says nothing about NVLink; it compares the
variants' protocol and launch costs (one-shot: no barrier; two-shot/direct: two barriers).
``--profile R``: also each call's kernel time (torch.profiler, free-running ranks, R replays),
profiled once every point is timed: timings taken after a profiler session ran 0.8-0.9 us slower
(N = 2, T = 2-16; benchmarks/results/2026-11-27-h200x1, third session).

  python benchmarks/loopback_bench.py --ranks 2 4 8 --tokens 1 16 64 256 --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.kernel.comm import CommSettings
from jax_tokenweave.kernel.loopback import LoopbackComm, reference


def _kernel_us(run) -> float:
    """Mean device time (us) of the fused kernels (``tokenweave::`` CUDA kernels) that
    ``run()`` launches, profiled after one unprofiled warm run: one kernel per rank per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    times = [
        e.device_time_total
        for e in prof.events()
        if "CUDA" in str(getattr(e, "device_type", "")) and "tokenweave" in e.name
    ]
    return statistics.fmean(times) if times else float("nan")


def _point_run(args: argparse.Namespace, comm: LoopbackComm, inputs: tuple, algo: str):
    """``comm.run`` of one point's inputs, with the command line's CTAs, graph size and
    residual layout."""
    return functools.partial(
        comm.run,
        *inputs,
        algo=algo,
        num_ctas=args.ctas,
        graph_calls=args.graph_calls,
        residual_replicated=args.residual == "replicated",
    )


def _new_comm(n: int) -> LoopbackComm:
    return LoopbackComm(n, CommSettings(workspace_mib=512, oneshot_mib=32, num_slots=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="group sizes N")
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=[1, 16, 64, 256], help="tokens T per call"
    )
    ap.add_argument("--hidden", type=int, default=8192, help="hidden size H (bf16)")
    ap.add_argument(
        "--algos", nargs="+", default=["one_shot", "two_shot", "direct"], help="kernel variants"
    )
    ap.add_argument("--ctas", type=int, default=8, help="CTAs per rank")
    ap.add_argument("--graph-calls", type=int, default=50, help="calls per captured graph")
    ap.add_argument("--replays", type=int, default=20, help="timed graph replays per point")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="graph replays profiled for each call's kernel time (0: none)",
    )
    ap.add_argument(
        "--residual",
        choices=["sharded", "replicated"],
        default="sharded",
        help="residual layout: token-sharded [q, H], or [T, H] on every rank (the decode "
        "one-shot kernel only: T <= --ctas)",
    )
    ap.add_argument("--out", type=Path, default=None, help="folder for JSON + markdown")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    rows = []
    points = [(n, t, a) for n in args.ranks for t in args.tokens for a in args.algos]
    inputs = {}
    replicated = args.residual == "replicated"
    for n, tokens, algo in tqdm(points, desc="loopback_bench"):
        q = tokens if replicated else ceil_div(tokens, n)
        partial = rng.standard_normal((n, tokens, args.hidden)).astype(ml_dtypes.bfloat16)
        residual = rng.standard_normal((n, q, args.hidden)).astype(ml_dtypes.bfloat16)
        if replicated:  # every rank's copy the same
            residual[1:] = residual[0]
        weight = rng.standard_normal(args.hidden).astype(np.float32)
        inputs[n, tokens, algo] = (partial, residual, weight)
        comm, runs = _new_comm(n), {}
        try:
            run = _point_run(args, comm, inputs[n, tokens, algo], algo)
            for free in (False, True):
                runs[free] = run(graph_replays=args.replays, free_running=free)
        finally:
            comm.close()
        for free, r in runs.items():
            if r.error is not None or r.mismatches:
                mode = "free-running" if free else "joined"
                print(f"N={n} T={tokens} {algo} ({mode}): FAILED ({r.error}, {r.mismatches})")
                return 1
        res = runs[False]
        want, _ = reference(partial, residual, weight, residual_replicated=replicated)
        got = res.normed[0].astype(np.float64)
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        rows.append(
            dict(
                ranks=n,
                tokens=tokens,
                hidden=args.hidden,
                algo=algo,
                ctas=args.ctas,
                residual=args.residual,
                us=statistics.median(res.call_us),
                us_min=min(res.call_us),
                us_free=statistics.median(runs[True].call_us),
                kernel_us=float("nan"),
                rel_err=err,
            )
        )
    if args.profile:  # after every timing: a profiler session slows the timings after it
        for row, (n, tokens, algo) in zip(rows, tqdm(points, desc="profile"), strict=True):
            comm = _new_comm(n)
            try:
                run = _point_run(args, comm, inputs[n, tokens, algo], algo)
                row["kernel_us"] = _kernel_us(
                    functools.partial(run, graph_replays=args.profile, free_running=True)
                )
            finally:
                comm.close()
    lines = [
        "| N | T | algo | us/call (median) | min | free-running us/call "
        "| kernel us/call (profiled) | rel err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['ranks']} | {r['tokens']} | {r['algo']} | {r['us']:.2f} | "
        f"{r['us_min']:.2f} | {r['us_free']:.2f} | {r['kernel_us']:.2f} | {r['rel_err']:.1e} |"
        for r in rows
    ]
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = dict(
            command=" ".join(["benchmarks/loopback_bench.py", *(argv or sys.argv[1:])]),
            date=time.strftime("%Y-%m-%d"),
            method="median of timed CUDA-graph replays "
            "(graph of --graph-calls calls) / calls; every rank on one GPU. us: every call "
            "forks the ranks' streams and joins them; us_free: each rank's calls back to "
            "back, forked and joined once per graph (as on GPUs of their own); kernel_us: "
            "torch.profiler, the mean duration of the fused kernels of --profile free-running "
            "replays, profiled after every point was timed (one kernel per rank per call; "
            "NaN without --profile)",
        )
        (args.out / "loopback_bench.json").write_text(
            json.dumps(dict(meta=meta, rows=rows), indent=1)
        )
        (args.out / "loopback_bench.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
