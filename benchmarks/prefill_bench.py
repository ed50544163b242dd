"""The serving engine's prefill steps against the bare decoder stack's prefill of the same tokens.

Workloads (``--workloads LENxN``: ``N`` requests of ``LEN`` prompt tokens, all added at once):
by default ``8192x1``, ``2048x4`` and ``32768x1`` on GPUs, the last chunked at
``--max-num-batched-tokens`` (8192) rows per step. The engine (``serving.LLMEngine``, the model
of ``--model`` with random weights, ``max_tokens=1``: a request finishes with its last chunk)
runs every step until the prompts are done; each step is timed (wall clock, as
``decode_bench.py`` times them) and their sum is the workload's time. One untimed run compiles
the layouts first, then ``--iters`` timed runs (median reported; compilations while timed are
counted and must be zero).

The bare stack: the same model's ``WeaveDecoder`` on the packed ``N x LEN`` tokens in one call,
measured exactly as ``benchmarks/e2e_bench.py`` measures a prefill (``jax_tokenweave.harness.modes.
measure``: compile, check against ``baseline``, warm-up, timed calls, median) with the engine's
schedule (``baseline``, or ``weave-<collective>``). It has no embedding, LM head, sampling, cache
writes or paging: ratio = engine / bare is what serving costs on top of the stack. Writes
``prefill.json`` and ``prefill.md`` into ``--out``. With no GPU it runs the tiny config on small
workloads (under a minute).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jax_tokenweave.harness import benchmarking as bm

WORKLOADS = {"gpu": ["8192x1", "2048x4", "32768x1"], "cpu": ["128x1", "32x4", "512x1"]}
CPU_BUDGET = 128


def decode_bench() -> Any:
    """``benchmarks/decode_bench.py`` (its model and engine options), loaded by path."""
    return bm.sibling_module(__file__, "decode_bench")


def workload(text: str) -> tuple[int, int]:
    """``"2048x4"`` -> ``(2048, 4)``: prompt length, requests (an ``argparse`` type)."""
    parts = text.lower().split("x")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not LENxN (e.g. 2048x4)")
    return bm.positive_int(parts[0]), bm.positive_int(parts[1])


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; see ``--help``."""
    db = decode_bench()
    p = bm.result_parser("prefill_bench.py", __doc__, "prefill")
    p.add_argument(
        "--workloads",
        type=workload,
        nargs="+",
        metavar="LENxN",
        help="N requests of LEN prompt tokens (default: 8192x1 2048x4 32768x1 on "
        "GPUs, 128x1 32x4 512x1 on CPUs)",
    )
    db.add_model_options(
        p, [n for n in db.ENGINE_OPTIONS if n != "max_num_batched_tokens"], plot=False
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=bm.positive_int,
        help="rows per engine step: longer prompts are chunked (default: 8192 on "
        f"GPUs, {CPU_BUDGET} on CPUs)",
    )
    p.add_argument(
        "--warmup",
        type=bm.nonnegative_int,
        default=2,
        help="bare stack: untimed calls per workload",
    )
    p.add_argument(
        "--iters",
        type=bm.positive_int,
        default=5,
        help="timed runs per workload, engine and bare stack (medians reported)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the options (``parser.error`` before any work on bad ones)."""
    return decode_bench().parse_args(argv, build_parser())


def resolve(args: argparse.Namespace, platform: str) -> argparse.Namespace:
    """``args`` with the platform's defaults filled in."""
    a = decode_bench().resolve(args, platform)
    gpu = platform == "gpu"
    a.workloads = a.workloads or [workload(w) for w in WORKLOADS["gpu" if gpu else "cpu"]]
    a.max_num_batched_tokens = a.max_num_batched_tokens or (8192 if gpu else CPU_BUDGET)
    return a


def engine_run(engine: Any, prompts: list[list[int]]) -> list[float]:
    """Add ``prompts`` (one new token each) and step until they are done; each step's ms."""
    from jax_tokenweave.serving import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    for i in ids:
        engine.release(i)
    return times


def run_workload(
    model: Any, a: argparse.Namespace, length: int, count: int, rng: np.random.Generator
) -> dict[str, Any]:
    """The engine's prefill steps and the bare stack's prefill of the same tokens."""
    from jax_tokenweave.harness.modes import Mode, measure
    from jax_tokenweave.serving import LLMEngine, count_compilations

    prompts = [rng.integers(0, model.config.vocab_size, length).tolist() for _ in range(count)]
    # the same prompts run again and again: without prefix caching, so each run prefills them
    config = decode_bench().engine_config(a, count, length + 1)
    engine = LLMEngine(model, dataclasses.replace(config, enable_prefix_caching=False))
    engine_run(engine, prompts)  # compiles the layouts
    with count_compilations() as compiles:
        runs = [engine_run(engine, prompts) for _ in range(a.iters)]
    budget = engine.config.max_num_batched_tokens
    del engine
    totals = [sum(r) for r in runs]
    steps = [t for r in runs for t in r]
    record = {
        "length": length,
        "requests": count,
        "tokens": length * count,
        "budget": budget,
        "engine_steps": len(runs[0]),
        "engine_ms": float(np.median(totals)),
        "engine_step_p50_ms": float(np.median(steps)),
        "engine_runs_ms": totals,
        "compilations": compiles.count,
    }
    mode = Mode("baseline") if a.schedule == "baseline" else Mode("weave", a.collective)
    config, mesh = model.config, model.mesh
    hidden = bm.random_hidden(
        length * count, config.hidden_size, bm.DTYPES[a.dtype], mesh, a.seed + length * count
    )
    info = measure(
        model.decoder,
        config,
        a.model,
        bm.request_lengths(length * count, length),
        hidden,
        {mode.name: mode},
        tol=bm.TOLERANCE[a.dtype],
        warmup=a.warmup,
        iters=a.iters,
    )[mode.name]
    record["bare"] = {"mode": mode.name, **{k: v for k, v in info.items() if k != "samples_ms"}}
    if info.get("status") == "ok":
        record["bare_ms"] = info["median_ms"]
        record["ratio"] = record["engine_ms"] / info["median_ms"]
    return record


def run(a: argparse.Namespace, devices: Sequence[Any]) -> dict[str, Any]:
    """Every workload on one model."""
    from jax_tokenweave.harness.modes import one_line

    model = decode_bench().build_model(a, devices)
    rng = np.random.default_rng(a.seed)
    records = []
    for length, count in a.workloads:
        print(f"prefill {count} x {length} tokens", file=sys.stderr, flush=True)
        try:
            record = {"status": "ok", **run_workload(model, a, length, count, rng)}
        except Exception as err:  # one failing workload must not end the run
            record = {
                "length": length,
                "requests": count,
                "status": "error",
                "reason": one_line(err),
            }
        records.append(record)
    return {
        "model": a.model,
        "layers": model.config.num_layers,
        "tp": a.tp,
        "schedule": a.schedule,
        "records": records,
    }


def to_markdown(report: dict[str, Any]) -> str:
    """One table: a row per workload."""
    env, cfg = report["environment"], report["config"]
    lines = [
        f"# Prefill: engine steps vs bare stack, {report['model']}, {report['layers']} "
        f"layers, TP {report['tp']} ({env['device_kind']})",
        "",
        f"jax {env['jax_version']}, commit {env['git_commit']}, {env['date']}; schedule "
        f"{report['schedule']}, {cfg['max_num_batched_tokens']} rows per step, "
        f"{cfg['dtype']}; medians of {cfg['iters']} runs. Ratio = engine / bare.",
        "",
        "| requests x tokens | engine steps | engine ms | engine ms / step | bare ms | "
        "ratio | compiles |",
        "|---" * 7 + "|",
    ]
    for r in report["records"]:
        head = f"| {r['requests']} x {r['length']} |"
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']}: {r['reason']} |" + " - |" * 5)
            continue
        bare = (
            f"{r['bare_ms']:.2f} | {r['ratio']:.3f}"
            if "ratio" in r
            else f"{r['bare'].get('status')}: {r['bare'].get('reason')} | -"
        )
        lines.append(
            f"{head} {r['engine_steps']} | {r['engine_ms']:.2f} | "
            f"{r['engine_step_p50_ms']:.2f} | {bare} | {r['compilations']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the workloads and write the outputs; 1 where one failed or compiled while timed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    platform, devices = bm.start_devices(max(args.tp, 1))
    a = resolve(args, platform)
    report = run(a, devices)
    report["environment"] = bm.environment(devices[: a.tp], ["benchmarks/prefill_bench.py", *argv])
    report["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    bm.sibling_module(__file__, "decode_report").write_outputs(
        report, a.out, "prefill", to_markdown(report)
    )
    if platform == "cpu":
        print(bm.CPU_NOTE)
    bad = [
        r for r in report["records"] if r["status"] != "ok" or r["compilations"] or "ratio" not in r
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
