"""Where prefill time goes: the weave schedule's ablations side by side, in one run.

Modes (``jax_tokenweave.harness.modes``), each the decoder stack on the same packed batch:

- ``baseline``: plain TP, XLA ``psum``, replicated residual, no split;
- ``nocomm``: ``baseline`` with every collective dropped: the floor (not the model's output);
- ``weave-local``: the weave schedule (split, token-sharded residual) with each collective
  replaced by a comm-free stand-in (own rows add + norm, tiled back): the split's own cost
  (not the model's output);
- ``weave-ffi-sync``: the weave schedule with the fused kernel called synchronously in the
  weave order: weave without the overlap;
- ``weave-xla``: the weave schedule with XLA reduce-scatter, norm, all-gather;
- ``weave-ffi``: TokenWeave: the fused kernel as start/done pairs overlapped with the other
  half's compute;
- ``weave-auto``: the library's default (``schedule="weave"``, ``collective="auto"``, split or not
  by the shipped tuning table).

The ``weave-*`` modes except ``weave-auto`` always split (what the split costs is the question);
their CTA counts are the tuning table's unless ``--ctas`` adds ``weave-ffi@<n>`` modes. Derived
columns: split cost = weave-local - nocomm; exposed communication = weave-ffi - weave-local;
overlap gain = weave-ffi-sync - weave-ffi; gap recovered = (baseline - weave-ffi) / (baseline -
nocomm); weave-ffi / nocomm and weave-auto / baseline. Every mode is timed the same way
(``jax_tokenweave.harness.timing.benchmark``: warm-up calls, then interleaved timed calls, medians);
the modes that compute the model are checked against ``baseline`` first. Modes that cannot run
(no fused kernel here) are reported as skipped. On CPUs (8 virtual devices, ``tiny``) it checks
the tool, not the overlap.

Writes ``breakdown.json``, ``breakdown.md`` and ``breakdown.png`` (unless ``--no-plot``) into
``--out``. On 2 GPUs::

    python benchmarks/breakdown.py --out results/breakdown --model llama3-70b --tp 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.harness.modes import Mode, measure
from jax_tokenweave.kernel import unavailable_reason
from jax_tokenweave.kernel.policy import ALGOS

_step_profile = bm.sibling_module(__file__, "step_profile")  # busy_ms (found under -P)

MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("baseline"),
        Mode("nocomm"),
        Mode("weave", "local", split=True),
        Mode("weave", "ffi-sync", split=True),
        Mode("weave", "xla", split=True),
        Mode("weave", "ffi", split=True),
        Mode("weave", "auto"),
    )
}
GPU = {"model": "llama3-70b", "tokens": (2048, 4096, 8192, 16384), "request_len": 1024}
CPU = {"model": "tiny", "tokens": (128, 256), "request_len": 64}


def _per_platform(key: str) -> str:
    show = lambda v: " ".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return f"(default: {show(GPU[key])} on GPUs, {show(CPU[key])} on CPUs)"


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; see ``--help``."""
    p = bm.result_parser("breakdown.py", __doc__, "breakdown")
    p.add_argument(
        "--model", help=f"model config name, {bm.config_names_help()} " + _per_platform("model")
    )
    p.add_argument(
        "--tp", type=bm.positive_int, help="tensor-parallel degree (default: all devices)"
    )
    p.add_argument(
        "--tokens",
        type=bm.positive_ints,
        nargs="+",
        action=bm.Flatten,
        help="batch sizes in tokens " + _per_platform("tokens"),
    )
    p.add_argument(
        "--request-len",
        type=bm.positive_int,
        help="tokens per request (the last one shorter if need be; one request of "
        "all the tokens: --request-len 16384 --tokens 16384) " + _per_platform("request_len"),
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=list(MODES),
        metavar="MODE",
        help="modes to run",
    )
    p.add_argument(
        "--ctas",
        type=bm.positive_ints,
        nargs="+",
        action=bm.Flatten,
        default=[],
        help="also time weave-ffi with each of these CTA counts (weave-ffi@<n>; "
        "default: none, the tuning table's counts only)",
    )
    p.add_argument(
        "--algos",
        nargs="+",
        default=[],
        choices=list(ALGOS),
        help="also time weave-ffi with each of these fused-call variants (weave-ffi[<algo>], "
        "with each --ctas count if any; default: none, the tuning table's variant only)",
    )
    p.add_argument(
        "--device-time",
        type=int,
        default=0,
        metavar="N",
        help="also profile N runs per mode and batch: device-busy ms and device ms per kernel "
        "class (gemm, fused, copy, ...; PyTorch's CUDA profiler, median over GPUs) (0: off)",
    )
    bm.add_run_options(p, warmup=2, iters=7, unit="mode and batch")
    bm.add_sweep_options(p, plot="breakdown.png")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the options (``parser.error`` before any work on bad ones)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.device_time < 0:
        p.error(f"--device-time must be >= 0, got {args.device_time}")
    if args.model is not None:
        try:
            bm.load_config(args.model, None)
        except ValueError as err:
            p.error(f"--model: {err}")
    if not args.no_plot and (hint := bm.matplotlib_missing()):
        p.error(f"the plot {hint} (or pass --no-plot)")
    args.parser = p
    return args


def derived(cell: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The derived columns of one batch from ``{mode: record}`` (None where a mode is missing)."""
    ms = {m: r["median_ms"] for m, r in cell.items() if r.get("status") == "ok"}
    diff = lambda a, b: ms[a] - ms[b] if a in ms and b in ms else None
    ratio = lambda a, b: ms[a] / ms[b] if a in ms and b in ms else None
    gap = diff("baseline", "nocomm")
    return {
        "split_cost_ms": diff("weave-local", "nocomm"),
        "exposed_comm_ms": diff("weave-ffi", "weave-local"),
        "overlap_gain_ms": diff("weave-ffi-sync", "weave-ffi"),
        "gap_recovered": (
            diff("baseline", "weave-ffi") / gap
            if gap and diff("baseline", "weave-ffi") is not None
            else None
        ),
        "weave_ffi_over_nocomm": ratio("weave-ffi", "nocomm"),
        "weave_auto_over_baseline": ratio("weave-auto", "baseline"),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every mode at every token count; returns the report."""
    platform, devices = bm.start_devices()
    d = GPU if platform == "gpu" else CPU
    args.model = args.model or d["model"]
    args.tokens = sorted(args.tokens or d["tokens"])
    args.request_len = args.request_len or d["request_len"]
    args.tp = args.tp or len(devices)
    if args.tp > len(devices):
        args.parser.error(
            f"--tp {args.tp} needs {args.tp} devices; this machine has {len(devices)}"
        )
    config = bm.load_config(args.model, args.layers)
    try:
        config.check_tensor_parallel(args.tp)
    except ValueError as err:
        args.parser.error(f"--tp {args.tp} does not fit --model {args.model}: {err}")
    modes = {n: MODES[n] for n in args.modes}
    modes.update({m.name: m for m in (Mode("weave", "ffi", split=True, ctas=c) for c in args.ctas)})
    forced = [
        Mode("weave", "ffi", split=True, ctas=c, algo=a)
        for a in args.algos
        for c in args.ctas or [None]
    ]
    modes.update({m.name: m for m in forced})
    seed = args.seed if args.seed is not None else bm.resolve_seed()
    dtype, tol = bm.DTYPES[args.dtype], bm.TOLERANCE[args.dtype]
    mesh = bm.make_mesh(devices, args.tp)
    decoder = bm.build_decoder(config, mesh, dtype, seed)
    n = args.device_time
    device_time = (lambda run: _step_profile.busy_ms(run, n)) if n > 0 else None
    start, rows = time.perf_counter(), []
    for i, tokens in enumerate(args.tokens):
        if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
            rows.append(
                {
                    "tokens": tokens,
                    "modes": {
                        n: {"status": "skipped", "reason": "time budget exhausted"} for n in modes
                    },
                }
            )
            continue
        print(f"-- T={tokens}: {', '.join(modes)}", flush=True)
        lengths = bm.request_lengths(tokens, args.request_len)
        hidden = bm.random_hidden(tokens, config.hidden_size, dtype, mesh, seed + 1 + i)
        cell = measure(
            decoder,
            config,
            args.model,
            lengths,
            hidden,
            modes,
            tol=tol,
            warmup=args.warmup,
            iters=args.iters,
            ffi_reason=unavailable_reason(mesh, "tp", dtype, (tokens, config.hidden_size)),
            device_time=device_time,
        )
        rows.append(
            {
                "tokens": tokens,
                "request_lengths": list(lengths),
                "modes": cell,
                "derived": derived(cell),
            }
        )
    keep = (
        "model",
        "layers",
        "tp",
        "tokens",
        "request_len",
        "modes",
        "ctas",
        "warmup",
        "iters",
        "dtype",
    )
    return {
        "environment": bm.environment(devices, ["benchmarks/breakdown.py", *args.argv]),
        "config": {
            **{k: getattr(args, k) for k in keep},
            "seed": seed,
            "tolerance": tol,
            "modes": list(modes),
        },
        "rows": rows,
    }


def _cell(record: dict[str, Any]) -> str:
    if record.get("status") == "ok":
        return f"{record['median_ms']:.2f}"
    return record.get("status", "-")


def to_markdown(report: dict[str, Any]) -> str:
    """The breakdown table (median ms per mode, derived columns) and the notes."""
    env, cfg = report["environment"], report["config"]
    modes = cfg["modes"]
    names = {
        "split_cost_ms": "split cost ms",
        "exposed_comm_ms": "exposed comm ms",
        "overlap_gain_ms": "overlap gain ms",
        "gap_recovered": "gap recovered",
        "weave_ffi_over_nocomm": "weave-ffi / nocomm",
        "weave_auto_over_baseline": "weave-auto / baseline",
    }
    lines = [
        f"# Breakdown ({env['num_devices']} x {env['device_kind']})",
        "",
        f"{cfg['model']}, {cfg['layers']} layers, TP={cfg['tp']}, {cfg['dtype']}, requests "
        f"of {cfg['request_len']} tokens; jax {env['jax_version']}, commit "
        f"{env['git_commit']}, {env['date']}; ms, median of {cfg['iters']} runs after "
        f"{cfg['warmup']} warm-up, all modes interleaved in one process.",
        "",
        "| tokens | " + " | ".join(modes) + " | " + " | ".join(names.values()) + " |",
        "|---" * (1 + len(modes) + len(names)) + "|",
    ]
    notes: dict[str, int] = {}
    for row in report["rows"]:
        cells = [str(row["tokens"])]
        for m in modes:
            r = row["modes"].get(m, {})
            cells.append(_cell(r))
            if r.get("status") not in ("ok", None):
                n = notes.setdefault(f"{m}: {r.get('reason', '')}", len(notes) + 1)
                cells[-1] += f" [{n}]"
        for key in names:
            value = row.get("derived", {}).get(key)
            cells.append(
                "-"
                if value is None
                else f"{value:.3f}"
                if "over" in key or key == "gap_recovered"
                else f"{value:.2f}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"[{n}] {text}" for text, n in notes.items())]
    lines += _device_lines(report)
    return "\n".join(lines).rstrip() + "\n"


def _device_lines(report: dict[str, Any]) -> list[str]:
    """With ``--device-time``: per batch and mode, device ms per kernel class (median GPU)."""
    cells = [
        (row["tokens"], m, r)
        for row in report["rows"]
        for m, r in row["modes"].items()
        if "device_class_ms" in r
    ]
    if not cells:
        return []
    classes = sorted({c for _, _, r in cells for c in r["device_class_ms"]})
    lines = [
        "",
        "Profiled device ms per run (median GPU): busy, then summed kernel time per class.",
        "",
        "| tokens | mode | busy | " + " | ".join(classes) + " |",
        "|---" * (3 + len(classes)) + "|",
    ]
    for tokens, m, r in cells:
        per = [f"{r['device_class_ms'].get(c, 0.0):.2f}" for c in classes]
        lines.append(f"| {tokens} | {m} | {r['device_ms']:.2f} | " + " | ".join(per) + " |")
    return lines


def write_plot(report: dict[str, Any], path: Path) -> bool:
    """Each mode's median time relative to nocomm, grouped by token count (False: nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in report["rows"] if r["modes"].get("nocomm", {}).get("status") == "ok"]
    modes = [
        m
        for m in report["config"]["modes"]
        if any(r["modes"].get(m, {}).get("status") == "ok" for r in rows)
    ]
    if not rows or not modes:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    width, x = 0.8 / len(modes), np.arange(len(rows))
    for i, m in enumerate(modes):
        vals = [
            r["modes"][m]["median_ms"] / r["modes"]["nocomm"]["median_ms"]
            if r["modes"].get(m, {}).get("status") == "ok"
            else np.nan
            for r in rows
        ]
        ax.bar(x + (i - (len(modes) - 1) / 2) * width, vals, width, label=m)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.axhline(1.02, color="gray", lw=0.8, ls=":")
    ax.set_xticks(x, [str(r["tokens"]) for r in rows])
    ax.set_xlabel("tokens in the batch")
    ax.set_ylabel("median time / nocomm")
    cfg = report["config"]
    ax.set_title(
        f"{cfg['model']} x{cfg['layers']}, TP={cfg['tp']}, {report['environment']['device_kind']}",
        fontsize=10,
    )
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run the breakdown and write its outputs; returns the exit status (1 on a mismatch)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "breakdown.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = to_markdown(report)
    (args.out / "breakdown.md").write_text(markdown)
    wrote = ["breakdown.json", "breakdown.md"]
    if not args.no_plot and write_plot(report, args.out / "breakdown.png"):
        wrote.append("breakdown.png")
    print(markdown)
    print(f"wrote {', '.join(wrote)} in {args.out}")
    if report["environment"]["platform"] == "cpu":
        print(bm.CPU_NOTE)
    mismatch = any(
        r.get("status") == "mismatch" for row in report["rows"] for r in row["modes"].values()
    )
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
