"""Request-level serving benchmark: the weave engine vs the same engine with the baseline schedule.

N synthetic requests (seeded: prompt lengths uniform in ``--prompt-len MIN MAX``, output lengths
uniform in ``--output-len MIN MAX``, random token ids, every request runs to its length) are
served by ``jax_tokenweave.serving.LLMEngine`` (continuous batching, chunked prefill, paged KV
cache) on a model of named shapes with random weights, once per schedule, for each workload:

- ``all-at-once``: every request arrives at time 0 (throughput);
- ``poisson``: arrivals at ``--rate`` requests per second (exponential gaps, seeded).

Reported per (workload, schedule): output and total token throughput (tokens/s), time to first
token and time per output token (p50 / p99), steps and woven steps, plus the weave/baseline
throughput ratio. Every step layout is loaded from the executable cache or compiled before the
clock starts (``LLMEngine.warmup``; the report's ``warmup`` gives how many of each, the seconds
of that call, ``warmup_s``, and with the first runs, ``seconds``) and each engine serves its
first eight requests once untimed; compilations during a timed run are counted and reported.
Writes ``serve.json``, ``serve.md`` and ``serve.png`` (``--no-plot`` to skip it; the plot needs
matplotlib, the ``plot`` extra).
With no GPU it runs the tiny config on 8 virtual CPU devices (timings say nothing about GPUs).

The GPU target (2 x H200, TP 2, Llama-3.3-70B shapes, 8 layers), install included::

    OUT=/tmp/serve bash benchmarks/gpu_serve.sh   # results/ for the tree, logs/ beside it
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jax_tokenweave.bench import benchmarking as bm
from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.serving.paged_attention import ATTENTION_IMPLS

WORKLOADS = ("all-at-once", "poisson")
SCHEDULES = ("weave", "baseline")
ENGINE_OPTIONS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "prefill_tile",
    "block_size",
    "key_chunk",
    "split_threshold",
)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; see ``--help``."""
    p = bm.result_parser("serve_bench.py", __doc__, "serve")
    p.add_argument(
        "--model",
        help=f"model config name, {bm.config_names_help()} "
        "(default: llama3-70b on GPUs, tiny on CPUs)",
    )
    p.add_argument(
        "--tp", type=bm.positive_int, help="tensor-parallel degree (default: all GPUs; 2 on CPUs)"
    )
    p.add_argument(
        "--dtype",
        choices=tuple(bm.DTYPES),
        default="bfloat16",
        help="parameter and activation dtype",
    )
    p.add_argument("--num-requests", type=bm.positive_int, default=256, help="requests per run")
    p.add_argument(
        "--prompt-len",
        type=bm.positive_int,
        nargs=2,
        default=[128, 4096],
        metavar=("MIN", "MAX"),
        help="prompt lengths, uniform in [MIN, MAX]",
    )
    p.add_argument(
        "--output-len",
        type=bm.positive_int,
        nargs=2,
        default=[64, 512],
        metavar=("MIN", "MAX"),
        help="output lengths, uniform in [MIN, MAX]",
    )
    p.add_argument(
        "--rate", type=bm.positive_float, default=4.0, help="poisson workload: requests per second"
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="arrival patterns to run",
    )
    p.add_argument(
        "--schedules",
        nargs="+",
        choices=SCHEDULES,
        default=list(SCHEDULES),
        help="engines to compare",
    )
    bm.add_collective_option(
        p, "auto", "the weave engine's reductions (auto: the fused kernel where it runs)"
    )
    bm.add_engine_options(p, ENGINE_OPTIONS)
    p.add_argument(
        "--no-command-buffers",
        action="store_true",
        help="decode steps without XLA command buffers (EngineConfig.command_buffers=False)",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTION_IMPLS,
        default="auto",
        help="the engines' paged attention (EngineConfig.attention)",
    )
    p.add_argument("--seed", type=bm.nonnegative_int, default=0, help="workload and weights seed")
    p.add_argument(
        "--no-plot",
        action="store_true",
        help="write no serve.png (the plot needs matplotlib: the plot extra)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the options (``parser.error`` before any work on bad ones)."""
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("prompt_len", "output_len"):
        lo, hi = getattr(args, name)
        if lo > hi:
            p.error(f"--{name.replace('_', '-')}: MIN ({lo}) exceeds MAX ({hi})")
    if not args.no_plot and (hint := bm.matplotlib_missing()):
        p.error(f"the plot {hint} (or pass --no-plot)")
    return args


def make_requests(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """The seeded synthetic requests: prompt ids, output length, Poisson arrival offset (s)."""
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    prompt_lens = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, n)
    output_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, n)
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, n))
    return [
        {
            "prompt": rng.integers(0, vocab, int(p)).tolist(),
            "output_len": int(o),
            "arrival_s": float(a),
        }
        for p, o, a in zip(prompt_lens, output_lens, arrivals, strict=True)
    ]


def serve(engine: Any, requests: list[dict[str, Any]], workload: str, desc: str) -> dict[str, Any]:
    """Serve ``requests`` on ``engine`` as ``workload``; the measured figures."""
    from jax_tokenweave.serving import SamplingParams, count_compilations

    poisson = workload == "poisson"
    order = sorted(range(len(requests)), key=lambda i: requests[i]["arrival_s"] if poisson else i)
    ids: dict[int, str] = {}
    steps0, split0 = engine.stats.steps, engine.stats.split_steps
    with count_compilations() as compiles, tqdm(total=len(requests), desc=desc, leave=False) as bar:
        start = time.perf_counter()
        pending = 0
        while pending < len(order) or engine.has_unfinished():
            now = time.perf_counter() - start
            while pending < len(order) and (
                not poisson or requests[order[pending]]["arrival_s"] <= now
            ):
                r = requests[order[pending]]
                arrival = start + (r["arrival_s"] if poisson else 0.0)
                ids[order[pending]] = engine.add_request(
                    r["prompt"],
                    SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True),
                    arrival_time=arrival,
                )
                pending += 1
            if not engine.has_unfinished():
                time.sleep(max(0.0, requests[order[pending]]["arrival_s"] - now))
                continue
            bar.update(sum(d.finished for d in engine.step()))
        elapsed = time.perf_counter() - start
    outs = [engine.release(ids[i]) for i in range(len(requests))]
    made = sum(len(o.token_ids) for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    ttft = [o.metrics.ttft for o in outs]
    tpot = [t for o in outs if (t := o.metrics.tpot(len(o.token_ids))) is not None]
    ms = lambda xs, q: float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else None
    return {
        "seconds": elapsed,
        "output_tokens": made,
        "prompt_tokens": prompt,
        "output_tok_s": made / elapsed,
        "total_tok_s": (made + prompt) / elapsed,
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "tpot_p50_ms": ms(tpot, 50),
        "tpot_p99_ms": ms(tpot, 99),
        "steps": engine.stats.steps - steps0,
        "split_steps": engine.stats.split_steps - split0,
        "compilations": compiles.count,
    }


def run(args: argparse.Namespace, devices: Sequence[Any], platform: str) -> dict[str, Any]:
    """Every (workload, schedule) run; the report's ``runs`` and ``ratios``."""
    import jax
    from flax import nnx

    from jax_tokenweave.models.llama import LlamaModel
    from jax_tokenweave.serving import EngineConfig, LLMEngine

    model_name = args.model or ("llama3-70b" if platform == "gpu" else "tiny")
    tp = args.tp or (len(devices) if platform == "gpu" else 2)
    config = bm.load_config(model_name, args.layers)
    mesh = bm.make_mesh(devices, tp)
    model = LlamaModel(config, mesh, dtype=bm.DTYPES[args.dtype], rngs=nnx.Rngs(args.seed))
    requests = make_requests(args, config.vocab_size)
    longest = args.prompt_len[1] + args.output_len[1]
    per_request = ceil_div(longest, args.block_size)
    engine_config = EngineConfig(
        **bm.engine_options(args, ENGINE_OPTIONS),
        max_model_len=longest,
        num_blocks=per_request * min(args.num_requests, args.max_num_seqs),
        collective=args.collective,
        max_logprobs=0,
        seed=args.seed,
        command_buffers=not args.no_command_buffers,
        attention=args.attention,
    )
    runs: dict[str, dict[str, Any]] = {w: {} for w in args.workloads}
    warmups: dict[str, dict[str, Any]] = {}
    for schedule in args.schedules:
        engine = LLMEngine(model, EngineConfig(**{**engine_config.__dict__, "schedule": schedule}))
        start = time.perf_counter()
        report = engine.warmup(progress=True)
        serve(engine, requests[:8], "all-at-once", f"warm-up {schedule}")  # first runs
        warmups[schedule] = {
            "layouts": report.layouts,
            "loaded": report.loaded,
            "compiled": report.compiled,
            "warmup_s": report.seconds,
            "seconds": time.perf_counter() - start,
            "compilation_cache_dir": engine.config.compilation_cache_dir,
        }
        print(
            f"{schedule}: {report.layouts} step layouts ({report.loaded} loaded from the "
            f"executable cache, {report.compiled} compiled) in {report.seconds:.1f}s, warmed "
            f"up in {warmups[schedule]['seconds']:.1f}s (compilation cache: "
            f"{engine.config.compilation_cache_dir})",
            file=sys.stderr,
        )
        for workload in args.workloads:
            runs[workload][schedule] = serve(engine, requests, workload, f"{workload} {schedule}")
            print(f"{workload} {schedule}: {_line(runs[workload][schedule])}", file=sys.stderr)
        del engine
        gc.collect()
        jax.clear_caches()
    ratios = {
        w: r["weave"]["output_tok_s"] / r["baseline"]["output_tok_s"]
        for w, r in runs.items()
        if {"weave", "baseline"} <= set(r)
    }
    return {
        "model": model_name,
        "layers": args.layers,
        "tp": tp,
        "engine": {k: v for k, v in engine_config.__dict__.items() if k != "tuning"},
        "runs": runs,
        "warmup": warmups,
        "throughput_ratio_weave_over_baseline": ratios,
    }


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['output_tok_s']:.1f} out tok/s, TTFT p50 {r['ttft_p50_ms']:.1f} ms, "
        f"TPOT p50 {r['tpot_p50_ms'] or 0:.2f} ms, {r['steps']} steps "
        f"({r['split_steps']} woven), {r['compilations']} compilations"
    )


def to_markdown(report: dict[str, Any]) -> str:
    """One table: a row per (workload, schedule), the weave/baseline ratios and the warm-ups
    (layouts loaded from the executable cache / compiled)."""
    rows = [
        "| workload | schedule | output tok/s | total tok/s | TTFT p50 / p99 ms | "
        "TPOT p50 / p99 ms | steps (woven) | compiles |",
        "|---" * 8 + "|",
    ]
    fmt = bm.number_or_dash
    for workload, per in report["runs"].items():
        for schedule, r in per.items():
            rows.append(
                f"| {workload} | {schedule} | {fmt(r['output_tok_s'])} | {fmt(r['total_tok_s'])}"
                f" | {fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p99_ms'])} | "
                f"{fmt(r['tpot_p50_ms'], 2)} / {fmt(r['tpot_p99_ms'], 2)} | {r['steps']} "
                f"({r['split_steps']}) | {r['compilations']} |"
            )
    ratios = report["throughput_ratio_weave_over_baseline"]
    lines = [
        f"Serving: {report['model']}, {report['layers']} layers, TP {report['tp']}, "
        f"{report['environment']['device_kind']}",
        "",
        *rows,
    ]
    if ratios:
        lines += [
            "",
            "Output throughput, weave / baseline: "
            + ", ".join(f"{w} {r:.3f}x" for w, r in ratios.items()),
        ]
    warm = report.get("warmup", {})
    if warm:
        lines += [
            "",
            "Warm-up, in run order (a later schedule reuses what this process compiled "
            "before it, so only the first is a cold start): "
            + "; ".join(
                f"{s} {w['layouts']} layouts ({w.get('loaded', 0)} loaded, "
                f"{w.get('compiled', w['layouts'])} compiled) in "
                f"{w.get('warmup_s', w['seconds']):.1f} s, {w['seconds']:.1f} s with the first runs"
                for s, w in warm.items()
            ),
        ]
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Throughput, TTFT and TPOT per workload, the schedules side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("output_tok_s", None, "output tokens / s"),
        ("ttft_p50_ms", "ttft_p99_ms", "TTFT ms (p50, p99 line)"),
        ("tpot_p50_ms", "tpot_p99_ms", "TPOT ms (p50, p99)"),
    )
    workloads = list(report["runs"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (key, p99, title) in zip(axes, panels, strict=True):
        for k, schedule in enumerate(SCHEDULES):
            xs = [i + 0.4 * k for i, w in enumerate(workloads) if schedule in report["runs"][w]]
            per = [report["runs"][w][schedule] for w in workloads if schedule in report["runs"][w]]
            ax.bar(xs, [r[key] or 0 for r in per], width=0.4, label=schedule)
            if p99:
                ax.scatter(xs, [r[p99] or 0 for r in per], marker="_", s=300, color="black")
        ax.set_xticks([i + 0.2 for i in range(len(workloads))], workloads)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(
        f"{report['model']} x{report['layers']} layers, TP {report['tp']}, "
        f"{report['environment']['device_kind']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Run both engines on the workloads and write the outputs; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    platform, devices = bm.start_devices()
    report = run(args, devices, platform)
    report["environment"] = bm.environment(devices, ["benchmarks/serve_bench.py", *argv])
    report["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "serve.md").write_text(to_markdown(report) + "\n")
    if not args.no_plot:
        write_plot(report, args.out / "serve.png")
    print(to_markdown(report))
    if platform == "cpu":
        print(bm.CPU_NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
