"""Regenerate the tuning table: per token count the fused kernel's CTA counts and the split
offset correction, and per (model, TP) the split threshold; write the table the library reads.

For each token count it times, the same way in one process (``jax_tokenweave.harness.timing``:
warm-up calls, then the median of ``--iters`` interleaved timed calls), the baseline schedule, the
weave schedule unsplit with the fused kernel (``--ctas``, and the kernel policy's count) and the
weave schedule split (``--offsets`` corrections to the planner's split point x ``--ctas``), each
with every ``--algos`` variant of the fused call (default: the kernel policy's), each output
checked against the baseline. The entry of a token count is the fastest candidate; the
threshold is the smallest measured token count from which the split wins at every larger one
(:func:`decide`). For each offset it also prints the compiled HLO's overlap check
(``harness.hlo_check``). Rows are written for ``--model`` and ``--tp`` (with the model's
shapes, so configs of the same shapes find them) into a ``jax_tokenweave.weave.tuning`` JSON table;
``--merge`` adds them to the table already at ``--out``, e.g. the shipped one::

    python benchmarks/tune.py --model llama3-70b --tp 2 --tokens 1024 2048 4096 8192 16384 \\
        --layers 8 --out jax_tokenweave/weave/tuning.json --merge

Without GPUs (or where the fused kernel cannot run) it prints why and exits 0, writing nothing.
``--time-budget`` bounds the run: no new measurement starts after it.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.harness import hlo_check, timing
from jax_tokenweave.kernel.policy import ALGOS
from jax_tokenweave.weave import tuning
from jax_tokenweave.weave.schedules import unavailable_reason
from jax_tokenweave.weave.tuning import TuneEntry, TuneTable

CTAS = (8, 16, 32)
OFFSETS = (-256, -128, 0, 128, 256)
TOKENS = (1024, 2048, 4096, 8192, 16384)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; see ``--help``."""
    p = argparse.ArgumentParser(
        prog="tune.py", description=__doc__.split("\n\n")[0], formatter_class=bm.HelpFormatter
    )
    p.add_argument(
        "--model", default="llama3-70b", help=f"model config name, {bm.config_names_help()}"
    )
    p.add_argument("--tp", type=bm.positive_int, default=2, help="tensor-parallel degree")
    p.add_argument(
        "--tokens",
        type=bm.positive_ints,
        nargs="+",
        action=bm.Flatten,
        default=list(TOKENS),
        help="batch sizes in tokens to tune",
    )
    p.add_argument("--layers", type=bm.positive_int, default=8, help="decoder layers to stack")
    p.add_argument(
        "--request-len",
        type=bm.positive_int,
        default=1024,
        help="tokens per request packed into the batch",
    )
    p.add_argument(
        "--ctas",
        type=bm.positive_ints,
        nargs="+",
        action=bm.Flatten,
        default=list(CTAS),
        help=f"CTA counts of the fused kernel to try, each in "
        f"[{tuning.MIN_CTAS}, {tuning.MAX_CTAS}]",
    )
    p.add_argument(
        "--algos",
        nargs="+",
        default=[],
        choices=list(ALGOS),
        help="fused-call variants to try for every candidate (default: the kernel policy's, by "
        "size); the entry keeps the fastest's",
    )
    p.add_argument(
        "--offsets",
        type=int,
        nargs="+",
        default=list(OFFSETS),
        help="corrections (tokens) to the planner's split point to try",
    )
    bm.add_run_options(p, warmup=2, iters=7, unit="candidate")
    p.add_argument(
        "--time-budget",
        type=bm.positive_float,
        default=900.0,
        metavar="SECONDS",
        help="start no new measurement after this many seconds",
    )
    p.add_argument(
        "--out", type=Path, metavar="JSON", help="tuning table to write (default: print only)"
    )
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
    return None, bm.make_mesh(devices, args.tp)


Candidate = tuple[bool, int, int | None, str | None]
"""``(split, offset correction, CTAs, variant)`` of one measured configuration (CTAs, variant
None: the kernel policy's)."""


def decide(
    times: Mapping[int, Mapping[Candidate, float]], current_threshold: int
) -> tuple[dict[int, TuneEntry], int]:
    """Entries and threshold from the medians ``times[tokens][candidate]`` (ms).

    Per token count, the entry holds the fastest candidate's CTAs and variant (split or not)
    and the best split candidate's offset. The threshold is the smallest measured token count
    from which the best split beats the best unsplit candidate at it and at every larger count;
    where the split wins at every count, ``min(current_threshold, smallest count)``; where it
    wins at the largest count nowhere, one more than the largest count.
    """
    entries: dict[int, TuneEntry] = {}
    wins: dict[int, bool] = {}
    for tokens, cands in sorted(times.items()):
        split = {c: t for c, t in cands.items() if c[0]}
        whole = {c: t for c, t in cands.items() if not c[0]}
        best = min(cands, key=cands.__getitem__)
        offset = min(split, key=split.__getitem__)[1] if split else None
        algo = best[3] if len(best) > 3 else None
        entries[tokens] = TuneEntry(offset or None, best[2], algo=algo)
        wins[tokens] = bool(split) and (not whole or min(split.values()) < min(whole.values()))
    counts = sorted(wins)
    if not counts:
        return entries, current_threshold
    threshold = max(counts) + 1
    for tokens in reversed(counts):
        if not wins[tokens]:
            break
        threshold = tokens
    if threshold == counts[0]:
        threshold = min(current_threshold, threshold)
    return entries, threshold


def tune_tokens(
    args, config, mesh, decoder, tokens: int, deadline: float
) -> dict[Candidate, float]:
    """Median ms of every candidate for one token count (those checked against baseline)."""
    dtype = bm.DTYPES[args.dtype]
    lengths = bm.request_lengths(tokens, args.request_len)
    hidden = bm.random_hidden(tokens, config.hidden_size, dtype, mesh, args.seed + tokens)
    key = (args.model, args.tp, tokens)
    base_plan = bm.make_plan(config, args.model, lengths, args.tp, split=False)
    base_run, _, _ = bm.compile_forward(decoder, base_plan, hidden, schedule="baseline")
    reference = base_run().astype(jnp.float32)
    fns: dict[str, Any] = {"baseline": base_run}
    names: dict[str, Candidate] = {}
    for split in (False, True):
        for offset in args.offsets if split else [0]:
            table = TuneTable({key: TuneEntry(offset, None)})
            plan = bm.make_plan(config, args.model, lengths, args.tp, split=split, table=table)
            if (why := unavailable_reason(mesh, "tp", dtype, plan, config.hidden_size)) is not None:
                print(f"   split={split} offset {offset}: skipped: {why}", flush=True)
                continue
            shown = False
            for ctas, algo in [(c, a) for a in args.algos or [None] for c in [*args.ctas, None]]:
                if time.perf_counter() > deadline:
                    break
                run, _, text = bm.compile_forward(
                    decoder,
                    plan,
                    hidden,
                    schedule="weave",
                    collective="ffi",
                    tuning=TuneEntry(None, ctas, algo=algo),
                )
                if split and not shown:
                    problems = hlo_check.overlap_problems(text)
                    print(
                        f"   halves {plan.half_lengths}: overlap "
                        f"{'ok' if not problems else '; '.join(problems)}",
                        flush=True,
                    )
                    shown = True
                name = f"split={split} offset={offset} ctas={ctas}" + (f" {algo}" if algo else "")
                err = timing.rel_error(run().astype(jnp.float32), reference)
                if not err <= bm.TOLERANCE[args.dtype]:
                    print(f"   {name}: relative error {err:.3g}: rejected", flush=True)
                    continue
                fns[name], names[name] = run, (split, offset, ctas, algo)
    stats = timing.benchmark(fns, warmup=args.warmup, iters=args.iters)
    base = stats["baseline"].median_ms
    for name in fns:
        ms = stats[name].median_ms
        print(f"   {name:42s} {ms:9.3f} ms  ({base / ms:.3f}x baseline)", flush=True)
    return {names[n]: stats[n].median_ms for n in names}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    why, mesh = skip_reason(args)
    if why is not None:
        print(f"tune.py: skipped: {why}")
        return 0
    config = bm.load_config(args.model, args.layers)
    config.check_tensor_parallel(args.tp)
    deadline = time.perf_counter() + args.time_budget
    old = tuning.load(args.out) if args.merge and args.out and args.out.exists() else TuneTable()
    decoder = bm.build_decoder(config, mesh, bm.DTYPES[args.dtype], args.seed)
    print(f"== {args.model} x{config.num_layers} layers, TP={args.tp}", flush=True)
    times: dict[int, dict[Candidate, float]] = {}
    try:
        for tokens in sorted(args.tokens):
            if time.perf_counter() > deadline:
                print(f"T={tokens}: time budget exhausted, skipped", flush=True)
                continue
            print(f"-- T={tokens}", flush=True)
            if found := tune_tokens(args, config, mesh, decoder, tokens, deadline):
                times[tokens] = found
    finally:
        del decoder
        gc.collect()
    entries, threshold = decide(times, old.threshold(args.model, args.tp))
    for tokens, entry in entries.items():
        print(f"T={tokens}: {entry}")
    print(f"split threshold of {args.model} at TP={args.tp}: {threshold}")
    if args.out is not None and entries:
        new = TuneTable(
            {(args.model, args.tp, t): e for t, e in entries.items()},
            {(args.model, args.tp): threshold},
            {args.model: tuning.signature(config)},
            {
                f"tune {args.model} tp{args.tp}": bm.environment(
                    bm.platform_devices()[1], ["benchmarks/tune.py", *(argv or [])]
                )
            },
        )
        extra = {
            (args.model, args.tp, t): {
                "candidates_ms": {str(c): ms for c, ms in sorted(times[t].items(), key=str)}
            }
            for t in entries
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tuning.save(old.merged(new), args.out, extra=extra)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
