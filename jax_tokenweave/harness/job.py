"""The main job: time the decoder stack's schedules side by side.

``python -m jax_tokenweave.bench`` builds a random-weight ``WeaveDecoder``, checks ``weave``
against ``baseline``, then times ``baseline``, ``weave`` and ``nocomm`` the same way and prints
medians and ratios (``--json``/``--plot`` save them; ``--help`` lists the options).
GPU defaults and the CPU run: docs/PACKAGE.md#harnessjob.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from jax_tokenweave.harness import timing
from jax_tokenweave.harness.benchmarking import (
    CPU_DEVICES,
    CPU_NOTE,
    DTYPES,
    SCHEDULES,
    TOLERANCE,
    Flatten,
    HelpFormatter,
    add_collective_option,
    build_decoder,
    compile_forward,
    config_names_help,
    environment,
    is_lead,
    load_config,
    make_mesh,
    make_plan,
    matplotlib_missing,
    nonnegative_int,
    positive_float,
    positive_int,
    positive_ints,
    random_hidden,
    request_lengths,
    resolve_seed,
    start_devices,
)
from jax_tokenweave.harness.report import config_dict, describe, format_table, result, write_plot
from jax_tokenweave.kernel import unavailable_reason
from jax_tokenweave.weave import tuning

PROG = "python -m jax_tokenweave.bench"


@dataclasses.dataclass(frozen=True)
class Defaults:
    """Per-platform defaults of the main job."""

    model: str
    layers: int
    tokens: tuple[int, ...]
    request_len: int
    warmup: int
    iters: int


GPU_DEFAULTS = Defaults("llama3-70b", 4, (2048, 8192), 1024, warmup=3, iters=20)
CPU_DEFAULTS = Defaults("tiny", 2, (1024, 2048, 4096), 256, warmup=3, iters=20)


def _per_platform(field: str) -> str:
    gpu, cpu = getattr(GPU_DEFAULTS, field), getattr(CPU_DEFAULTS, field)
    show = lambda v: " ".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return (
        f"(default: {show(gpu)})"
        if gpu == cpu
        else f"(default: {show(gpu)} on GPUs, {show(cpu)} on CPUs)"
    )


# ------------------------------------------------------------------------------- arguments ---


def _schedules(text: str) -> list[str]:
    names = [s for s in text.replace(",", " ").split() if s]
    bad = [s for s in names if s not in SCHEDULES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown schedule(s) {bad or [text]}; choose from {', '.join(SCHEDULES)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    """The main job's command-line parser (defaults of None are filled in per platform)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=HelpFormatter,
        description="Time TokenWeave's schedules (baseline / weave / nocomm) side by side. "
        f"Defaults on GPUs: {GPU_DEFAULTS.model}, {GPU_DEFAULTS.layers} layers, "
        f"TP = number of GPUs; with no GPU: {CPU_DEFAULTS.model} on {CPU_DEVICES} "
        "virtual CPU devices (CPU timings say nothing about GPU overlap).",
    )
    p.add_argument(
        "--model", help=f"model config name, {config_names_help()} " + _per_platform("model")
    )
    p.add_argument(
        "--layers", type=positive_int, help="decoder layers to stack " + _per_platform("layers")
    )
    p.add_argument("--tp", type=positive_int, help="tensor-parallel degree (default: all devices)")
    p.add_argument(
        "--tokens",
        type=positive_ints,
        nargs="+",
        action=Flatten,
        help="batch sizes in tokens, e.g. --tokens 2048 8192 (or 2048,8192) "
        + _per_platform("tokens"),
    )
    p.add_argument(
        "--request-len",
        type=positive_int,
        help="tokens per request packed into the batch " + _per_platform("request_len"),
    )
    add_collective_option(
        p,
        "auto",
        "how the weave schedule's reductions are done: xla (reduce-scatter, norm, all-gather), "
        "ffi (the fused CUDA kernel) or auto (ffi where it can run, else xla)",
    )
    p.add_argument(
        "--schedules",
        type=_schedules,
        nargs="+",
        action=Flatten,
        help=f"schedules to time (default: {' '.join(SCHEDULES)})",
    )
    p.add_argument(
        "--split-threshold",
        type=positive_int,
        help="split batches of at least this many tokens in two halves (default: "
        "the shipped tuning table's: "
        f"{tuning.shipped().describe_thresholds()})",
    )
    p.add_argument(
        "--warmup",
        type=nonnegative_int,
        help="untimed calls per schedule " + _per_platform("warmup"),
    )
    p.add_argument(
        "--iters", type=positive_int, help="timed calls per schedule " + _per_platform("iters")
    )
    p.add_argument(
        "--dtype", choices=tuple(DTYPES), default="bfloat16", help="parameter and activation dtype"
    )
    p.add_argument(
        "--tol",
        type=positive_float,
        help="max relative error of weave vs baseline (default: by dtype, "
        + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items())
        + ")",
    )
    p.add_argument("--seed", type=nonnegative_int, help="random seed (default: fresh)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    p.add_argument(
        "--plot",
        type=Path,
        metavar="PATH",
        help="write a bar chart (PNG; needs matplotlib: the plot extra)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def resolve_args(
    args: argparse.Namespace, platform: str, num_devices: int, parser: argparse.ArgumentParser
) -> argparse.Namespace:
    """Fill in platform defaults and check the combination; ``parser.error`` on bad input."""
    d = GPU_DEFAULTS if platform == "gpu" else CPU_DEFAULTS
    args.model = args.model or d.model
    args.layers = args.layers or d.layers
    args.tp = args.tp or num_devices
    args.tokens = sorted(args.tokens) if args.tokens else list(d.tokens)
    args.request_len = args.request_len or d.request_len
    args.warmup = d.warmup if args.warmup is None else args.warmup
    args.iters = args.iters or d.iters
    args.schedules = args.schedules or list(SCHEDULES)
    args.tol = TOLERANCE[args.dtype] if args.tol is None else args.tol
    if args.tp > num_devices:
        parser.error(
            f"--tp {args.tp} needs {args.tp} devices; this machine has {num_devices} "
            f"{platform.upper()} device(s)"
        )
    try:
        config = load_config(args.model, args.layers)
    except (KeyError, ValueError) as err:
        parser.error(f"--model {args.model!r}: {err}")
    try:
        config.check_tensor_parallel(args.tp)
    except ValueError as err:
        parser.error(f"--tp {args.tp} does not fit --model {args.model}: {err}")
    args.config = config
    if args.seed is None:
        args.seed = resolve_seed()
    return args


# ------------------------------------------------------------------------------------- run ---


def run(
    args: argparse.Namespace, devices: Sequence[jax.Device], parser: argparse.ArgumentParser
) -> dict[str, Any]:
    """Verify and time every schedule for every token count; returns the results dict."""
    from tqdm import tqdm

    config, dtype = args.config, DTYPES[args.dtype]
    mesh = make_mesh(devices, args.tp)
    comm_used = {}
    for tokens in args.tokens:
        reason = unavailable_reason(mesh, "tp", dtype, (tokens, config.hidden_size))
        if args.collective == "ffi" and "weave" in args.schedules and reason is not None:
            parser.error(f"--collective ffi is unavailable for {tokens} tokens here: {reason}")
        comm_used[tokens] = (
            ("ffi" if reason is None else f"xla (ffi unavailable: {reason})")
            if args.collective == "auto"
            else args.collective
        )
    decoder = build_decoder(config, mesh, dtype, args.seed)
    verify = "weave" in args.schedules
    steps = len(args.tokens) * len(args.schedules) * (args.warmup + args.iters)
    bar = tqdm(
        total=steps,
        desc="bench",
        unit="call",
        disable=args.no_progress,
        dynamic_ncols=True,
        file=sys.stderr,
    )
    results = []
    try:
        for i, tokens in enumerate(args.tokens):
            lengths = request_lengths(tokens, args.request_len)
            plan = make_plan(config, args.model, lengths, args.tp, threshold=args.split_threshold)
            hidden = random_hidden(tokens, config.hidden_size, dtype, mesh, args.seed + 1 + i)
            fns, compile_s = {}, {}
            names = list(args.schedules)
            if verify and "baseline" not in names:
                names.append("baseline")
            for name in names:
                bar.set_description(f"T={tokens} compile {name}")
                collective = args.collective if name == "weave" else "auto"
                fns[name], compile_s[name], _ = compile_forward(
                    decoder, plan, hidden, schedule=name, collective=collective
                )
            rel_err = None
            if verify:
                bar.set_description(f"T={tokens} verify")
                rel_err = timing.rel_error(fns["weave"](), fns["baseline"]())
                if not rel_err <= args.tol:
                    bar.close()
                    raise VerificationError(tokens, rel_err, args.tol, args.dtype)
            bar.set_description(f"T={tokens} time")
            stats = timing.benchmark(
                {n: fns[n] for n in args.schedules},
                warmup=args.warmup,
                iters=args.iters,
                on_step=lambda: bar.update(1),
            )
            results.append(
                result(tokens, lengths, plan, rel_err, comm_used[tokens], stats, compile_s)
            )
            del fns
    finally:
        bar.close()
    return {
        "environment": environment(devices, ["-m", "jax_tokenweave.bench", *args.argv]),
        "config": config_dict(args),
        "results": results,
    }


class VerificationError(RuntimeError):
    """weave's output differs from baseline's by more than the tolerance."""

    def __init__(self, tokens: int, rel_err: float, tol: float, dtype: str) -> None:
        super().__init__(
            f"weave and baseline disagree at {tokens} tokens: relative error {rel_err:.3g} > "
            f"tolerance {tol:.3g} ({dtype}); refusing to report timings"
        )
        self.tokens, self.rel_err, self.tol = tokens, rel_err, tol


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad arguments raises ``SystemExit``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    if args.plot and (hint := matplotlib_missing()):
        parser.error(f"--plot {hint}")
    platform, devices = start_devices()
    resolve_args(args, platform, len(devices), parser)
    try:
        report = run(args, devices, parser)
    except VerificationError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(describe(report))
    for r in report["results"]:
        if r["rel_err_weave_vs_baseline"] is not None:
            print(
                f"  T={r['tokens']}: weave vs baseline relative error "
                f"{r['rel_err_weave_vs_baseline']:.2e} (tolerance {args.tol:.0e}); "
                f"weave comm: {r['weave_comm']}"
            )
    print(format_table(report))
    print(
        "speedup = baseline / schedule (higher is better); weave/nocomm = 1.00 when all "
        "communication is hidden"
    )
    if platform == "cpu":
        print(CPU_NOTE)
    if not is_lead():  # one process per device: the first one writes
        return 0
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0
