"""Tune the weave-ffi schedule: CTA count x split offset per (model, TP, tokens); write the table.

For each token count, every split offset (from the midpoint; offsets that empty a half are left
out) and every CTA count, compiles ``WeaveDecoder(schedule="weave", comm="ffi",
tuning=TuneEntry(offset, num_ctas))`` on a packed batch, checks its output against the baseline
schedule, times it (``jax_tokenweave.timing.benchmark``: warm-up calls, then the median of
``--iters`` timed calls, the CTA variants of one offset interleaved), and keeps the fastest. The
default entry (16 CTAs, 8 for the first call, the split module's offset) is timed beside them
as the reference. For each offset it also prints the compiled HLO's overlap check
(``jax_tokenweave.hlo_check``). The result is a ``jax_tokenweave.tuning`` JSON table (with
``latency_ms``, ``default_ms`` and every candidate's median as informational keys); ``--merge``
adds to an existing one.

Without GPUs (or where the fused kernel cannot run) it prints why and exits 0, writing nothing.
``--time-budget`` bounds the run: no new measurement starts after it. Example (2 GPUs)::

    python benchmarks/tune.py --model llama3-70b --tp 2 --tokens 2048 8192 --layers 4 \\
        --out benchmarks/results/tune.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jax_tokenweave import benchmarking as bm
from jax_tokenweave import hlo_check, timing, tuning
from jax_tokenweave.layers import ffi_unavailable
from jax_tokenweave.split import PAD_MULTIPLE, midpoint, plan_batch
from jax_tokenweave.tuning import TuneEntry

CTAS = (4, 8, 16, 32)
OFFSETS = (-256, -128, 0, 128, 256)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; see ``--help``."""
    p = argparse.ArgumentParser(prog="tune.py", description=__doc__.split("\n\n")[0],
                                formatter_class=bm.HelpFormatter)
    p.add_argument("--model", default="llama3-70b",
                   help=f"model config name, {bm.config_names_help()}")
    p.add_argument("--tp", type=bm.positive_int, default=2, help="tensor-parallel degree")
    p.add_argument("--tokens", type=bm.positive_ints, nargs="+", action=bm.Flatten,
                   default=[2048, 8192], help="batch sizes in tokens to tune")
    p.add_argument("--layers", type=bm.positive_int, default=4, help="decoder layers to stack")
    p.add_argument("--request-len", type=bm.positive_int, default=1024,
                   help="tokens per request packed into the batch")
    p.add_argument("--ctas", type=bm.positive_ints, nargs="+", action=bm.Flatten,
                   default=list(CTAS),
                   help=f"CTA counts of the fused kernel to try, each in "
                        f"[{tuning.MIN_CTAS}, {tuning.MAX_CTAS}]")
    p.add_argument("--offsets", type=int, nargs="+", default=list(OFFSETS),
                   help="split offsets from the midpoint to try (tokens)")
    bm.add_run_options(p, warmup=2, iters=10, unit="candidate")
    p.add_argument("--time-budget", type=bm.positive_float, default=600.0, metavar="SECONDS",
                   help="start no new measurement after this many seconds")
    p.add_argument("--out", type=Path, metavar="JSON",
                   help="tuning table to write (default: print only)")
    p.add_argument("--merge", action="store_true", help="add to the table already at --out")
    p.add_argument("--seed", type=bm.nonnegative_int, default=0, help="random seed")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the options (``parser.error`` on bad ones)."""
    p = build_parser()
    args = p.parse_args(argv)
    for c in args.ctas:
        if not tuning.MIN_CTAS <= c <= tuning.MAX_CTAS:
            p.error(f"--ctas: {c} is outside [{tuning.MIN_CTAS}, {tuning.MAX_CTAS}]")
    from jax_tokenweave.models.configs import config_names

    if args.model not in config_names():
        p.error(f"--model: unknown model {args.model!r}; {bm.config_names_help()}")
    return args


def skip_reason(args: argparse.Namespace) -> tuple[str | None, Any]:
    """Why nothing can be tuned here (None where it can) and the mesh."""
    platform, devices = bm.platform_devices()
    if platform != "gpu":
        return "no CUDA GPUs: the fused kernel runs only on GPUs", None
    if len(devices) < args.tp:
        return f"TP={args.tp} needs {args.tp} GPUs, this machine has {len(devices)}", None
    mesh = bm.make_mesh(devices, args.tp)
    return None, mesh


def tune_tokens(args, config, mesh, decoder, tokens: int, deadline: float):
    """Measure every (offset, CTAs) for one token count; returns (best entry, info) or None."""
    dtype = bm.DTYPES[args.dtype]
    lengths = bm.request_lengths(tokens, args.request_len)
    hidden = bm.random_hidden(tokens, config.hidden_size, dtype, mesh, args.seed + tokens)
    base_run, _, _ = bm.compile_forward(
        decoder, bm.make_plan(config, args.model, lengths, args.tp), hidden, schedule="baseline")
    reference = base_run().astype(jnp.float32)
    tol = bm.TOLERANCE[args.dtype]
    results: dict[tuple[int | None, int, int | None], float] = {}

    def measure(plan, entries: Sequence[TuneEntry]) -> None:
        why = ffi_unavailable(mesh, "tp", dtype, plan, config.hidden_size)
        if why is not None:
            print(f"   offset {plan.offset}: skipped: {why}", flush=True)
            return
        fns, shown = {}, False
        for e in entries:
            if time.perf_counter() > deadline:
                break
            run, _, text = bm.compile_forward(decoder, plan, hidden, schedule="weave", comm="ffi",
                                              tuning=e)
            if not shown:
                problems = hlo_check.overlap_problems(text)
                print(f"   offset {plan.offset} halves {plan.half_lengths}: overlap "
                      f"{'ok' if not problems else '; '.join(problems)}", flush=True)
                shown = True
            err = timing.rel_error(run().astype(jnp.float32), reference)
            if not err <= tol:
                print(f"   {e}: relative error {err:.3g} > {tol}: rejected", flush=True)
                continue
            fns[e] = run
        if fns:
            stats = timing.benchmark({str(k): f for k, f in fns.items()}, warmup=args.warmup,
                                     iters=args.iters)
            for e in fns:
                ms = stats[str(e)].median_ms
                results[(plan.offset, e.num_ctas, e.first_num_ctas)] = ms
                print(f"   offset {plan.offset:5d} ctas {e.num_ctas:2d} first "
                      f"{e.first_num_ctas or e.num_ctas:2d}: {ms:.3f} ms", flush=True)

    default_plan = bm.make_plan(config, args.model, lengths, args.tp, split=True)
    measure(default_plan, [tuning.DEFAULT_ENTRY])
    default_key = (default_plan.offset, tuning.DEFAULT_ENTRY.num_ctas,
                   tuning.DEFAULT_ENTRY.first_num_ctas)
    lo, hi = 1 - midpoint(tokens), tokens - 1 - midpoint(tokens)
    for offset in args.offsets:
        if time.perf_counter() > deadline:
            print("   time budget exhausted", flush=True)
            break
        if not lo <= offset <= hi:
            print(f"   offset {offset}: leaves a half empty (T={tokens}), skipped", flush=True)
            continue
        plan = plan_batch(lengths, tp=args.tp, split=True, offset=offset)
        measure(plan, [TuneEntry(offset, c) for c in args.ctas])
    if not results:
        return None
    (offset, ctas, first), ms = min(results.items(), key=lambda kv: kv[1])
    entry = TuneEntry(offset, ctas, first)
    info = {"latency_ms": ms, "default_ms": results.get(default_key),
            "candidates": [{"offset": o, "num_ctas": c, "first_num_ctas": f, "median_ms": t}
                           for (o, c, f), t in sorted(results.items(), key=lambda kv: kv[1])]}
    return entry, info


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    why, mesh = skip_reason(args)
    if why is not None:
        print(f"tune.py: skipped: {why}")
        return 0
    config = bm.load_config(args.model, args.layers)
    config.check_tensor_parallel(args.tp)
    deadline = time.perf_counter() + args.time_budget
    table: dict = {}
    if args.merge and args.out is not None and args.out.exists():
        table = dict(tuning.load(args.out))
    extra: dict = {}
    decoder = bm.build_decoder(config, mesh, bm.DTYPES[args.dtype], args.seed)
    print(f"== {args.model} x{config.num_layers} layers, TP={args.tp} (midpoint padding "
          f"{PAD_MULTIPLE})", flush=True)
    try:
        for tokens in args.tokens:
            if time.perf_counter() > deadline:
                print(f"T={tokens}: time budget exhausted, skipped", flush=True)
                continue
            print(f"-- T={tokens}", flush=True)
            found = tune_tokens(args, config, mesh, decoder, tokens, deadline)
            if found is None:
                print(f"T={tokens}: nothing measured", flush=True)
                continue
            entry, info = found
            key = (args.model, args.tp, tokens)
            table[key], extra[key] = entry, info
            default = info["default_ms"]
            default = "not measured" if default is None else f"{default:.3f} ms"
            print(f"T={tokens}: best {entry} {info['latency_ms']:.3f} ms (default entry "
                  f"{default})", flush=True)
    finally:
        del decoder
        gc.collect()
    if args.out is not None and extra:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tuning.save(table, args.out, extra=extra)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
