"""Request-level serving benchmark: the weave engine vs the baseline schedule, each under the KV
cache policies (blocks on demand with prefix caching, reserved at admission, on demand without
prefix caching).

Synthetic requests (``serve_workloads.py``: random token ids, seeded) are served by
``jax_tokenweave.serving.LLMEngine`` (continuous batching, chunked prefill, paged KV cache) on a
model of named shapes with random weights, once per (schedule, policy), for each workload:
``all-at-once`` and ``poisson`` (uniform lengths, each request runs to its length), ``chat``
(log-normal lengths, every request asking for ``--chat-max-tokens`` and ended by the client at
its drawn length, as a stop string would end it) and ``shared-prefix`` (one system prompt, short
questions). Reported per run: output and total throughput, TTFT and TPOT (p50 / p99), steps,
woven steps and steps cut to the bucket below, preemptions, prefix-cache hits, the most
requests running at once, failed requests; then weave / baseline, on-demand / reserve and
prefix cache on / off ratios; on GPUs each run's time over its floor (``serve_floor.py``).
Every step layout is loaded or compiled before the clock starts (``LLMEngine.warmup``) and each
engine serves eight requests once untimed; the prefix cache is emptied before each timed run.
Writes ``serve.json``, ``serve.md`` and ``serve.png`` (``--no-plot``: none; the plot needs the
``plot`` extra). With no GPU it runs the tiny config on 8 virtual CPU devices (timings say
nothing about GPUs).

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

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.serving.attention.paged_attention import ATTENTION_IMPLS

workloads = bm.sibling_module(__file__, "serve_workloads")
serve_report = bm.sibling_module(__file__, "serve_report")
serve_floor = bm.sibling_module(__file__, "serve_floor")
WORKLOADS = workloads.WORKLOADS
SCHEDULES = ("weave", "baseline")
POLICIES = {
    "on-demand": {"kv_allocation": "on_demand", "enable_prefix_caching": True},
    "reserve": {"kv_allocation": "reserve", "enable_prefix_caching": False},
    "no-prefix-cache": {"kv_allocation": "on_demand", "enable_prefix_caching": False},
}
"""The KV cache policies a run compares: ``EngineConfig`` fields."""
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
    workloads.add_options(p, bm.positive_int, bm.positive_float)
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=["all-at-once", "poisson"],
        help="request patterns to run",
    )
    p.add_argument(
        "--schedules",
        nargs="+",
        choices=SCHEDULES,
        default=list(SCHEDULES),
        help="engines to compare",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        choices=tuple(POLICIES),
        default=list(POLICIES),
        help="KV cache policies to compare: blocks on demand with prefix caching, reserved at "
        "admission (prompt + max_tokens, no prefix caching), on demand without prefix caching",
    )
    bm.add_collective_option(
        p, "auto", "the weave engine's reductions (auto: the fused kernel where it runs)"
    )
    bm.add_engine_options(p, ENGINE_OPTIONS)
    kv = p.add_mutually_exclusive_group()
    kv.add_argument(
        "--num-blocks",
        type=bm.positive_int,
        help="KV cache blocks (default: every request's prompt + max_tokens for max_num_seqs "
        "requests at once)",
    )
    kv.add_argument(
        "--gpu-memory-utilization",
        type=bm.positive_float,
        help="size the KV cache as LLM does: this share of each device's memory less the "
        "weights and an activation reserve (serving.offline.resolve.cache_blocks)",
    )
    p.add_argument(
        "--no-command-buffers",
        action="store_true",
        help="decode steps without XLA command buffers (EngineConfig.command_buffers=False)",
    )
    p.add_argument(
        "--no-trim-to-bucket",
        action="store_true",
        help="steps with prompt chunks pad up to their bucket, never cut to the one below "
        "(EngineConfig.trim_to_bucket=False)",
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
    if problem := workloads.check(args):
        p.error(problem)
    if not args.no_plot and (hint := bm.matplotlib_missing()):
        p.error(f"the plot {hint} (or pass --no-plot)")
    return args


def make_requests(args: argparse.Namespace, vocab: int) -> dict[str, list[dict[str, Any]]]:
    """The seeded requests of each workload asked for (``serve_workloads.make_requests``)."""
    return {w: workloads.make_requests(w, args, vocab) for w in args.workloads}


def serve(engine: Any, requests: list[dict[str, Any]], workload: str, desc: str) -> dict[str, Any]:
    """Serve ``requests`` on ``engine`` as ``workload``, ending each at its ``output_len``
    (aborted by the client where that is below its ``max_tokens``); the measured figures."""
    from jax_tokenweave.serving import SamplingParams, count_compilations

    poisson = workload == "poisson"
    order = sorted(range(len(requests)), key=lambda i: requests[i]["arrival_s"])
    ids: dict[int, str] = {}
    index: dict[str, int] = {}
    made: dict[str, int] = {}
    stats, kv = engine.stats, engine.kv_stats
    before = (stats.steps, stats.split_steps, kv.preemptions, kv.prefix_cache_queries)
    hits0, peak, trimmed0 = kv.prefix_cache_hits, 0, engine.scheduler.trimmed_steps
    with count_compilations() as compiles, tqdm(total=len(requests), desc=desc, leave=False) as bar:
        start = time.perf_counter()
        pending = 0
        while pending < len(order) or engine.has_unfinished():
            now = time.perf_counter() - start
            while pending < len(order) and (
                not poisson or requests[order[pending]]["arrival_s"] <= now
            ):
                i = order[pending]
                r = requests[i]
                params = SamplingParams(
                    temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True
                )
                ids[i] = rid = engine.add_request(
                    r["prompt"], params, arrival_time=start + (r["arrival_s"] if poisson else 0.0)
                )
                index[rid], made[rid] = i, 0
                pending += 1
            if not engine.has_unfinished():
                time.sleep(max(0.0, requests[order[pending]]["arrival_s"] - now))
                continue
            for d in engine.step():
                bar.update(d.finished)
                made[d.request_id] += len(d.token_ids)
                wanted = requests[index[d.request_id]]["output_len"]
                if not d.finished and made[d.request_id] >= wanted:
                    engine.abort(d.request_id)  # the client has what it wanted
            peak = max(peak, len(engine.scheduler.running))
        elapsed = time.perf_counter() - start
    outs = [engine.release(ids[i]) for i in range(len(requests))]
    out_tokens = sum(len(o.token_ids) for o in outs)
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    ttft = [o.metrics.ttft for o in outs if o.metrics.first_token_time is not None]
    tpot = [t for o in outs if (t := o.metrics.tpot(len(o.token_ids))) is not None]
    ms = lambda xs, q: float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else None
    return {
        "seconds": elapsed,
        "requests": len(outs),
        "failed": sum(o.finish_reason not in ("stop", "length", "abort") for o in outs),
        "ended_by_client": sum(o.finish_reason == "abort" for o in outs),
        "output_tokens": out_tokens,
        "prompt_tokens": prompt,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + prompt) / elapsed,
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "tpot_p50_ms": ms(tpot, 50),
        "tpot_p99_ms": ms(tpot, 99),
        "steps": stats.steps - before[0],
        "split_steps": stats.split_steps - before[1],
        "trimmed_steps": engine.scheduler.trimmed_steps - trimmed0,
        "preemptions": kv.preemptions - before[2],
        "prefix_cache_queries": kv.prefix_cache_queries - before[3],
        "prefix_cache_hits": kv.prefix_cache_hits - hits0,
        "peak_running": peak,
        "compilations": compiles.count,
    }


def kv_blocks(args: argparse.Namespace, model: Any, max_model_len: int) -> tuple[int, str]:
    """The KV cache's blocks (the same for every engine) and how they were sized."""
    from jax_tokenweave.serving import EngineConfig
    from jax_tokenweave.serving.offline.resolve import cache_blocks

    if args.num_blocks:
        return args.num_blocks, "--num-blocks"
    probe = EngineConfig(**bm.engine_options(args, ENGINE_OPTIONS), max_model_len=max_model_len)
    if args.gpu_memory_utilization:
        devices = list(model.mesh.devices.flat)
        dtype = model.embed.get_value().dtype
        blocks = cache_blocks(devices, model.config, probe, dtype, args.gpu_memory_utilization)
        return blocks, f"gpu_memory_utilization {args.gpu_memory_utilization}"
    per_request = ceil_div(max_model_len, args.block_size)
    return per_request * min(args.num_requests, args.max_num_seqs), "max_num_seqs requests"


def run(args: argparse.Namespace, devices: Sequence[Any], platform: str) -> dict[str, Any]:
    """Every (workload, schedule, policy) run; the report's ``runs`` and ratios."""
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
    rates = measure_rates(devices[0], model) if platform == "gpu" else None
    itemsize = np.dtype(bm.DTYPES[args.dtype]).itemsize
    longest = max(len(r["prompt"]) + r["max_tokens"] for rs in requests.values() for r in rs)
    num_blocks, sizing = kv_blocks(args, model, longest)
    engine_config = EngineConfig(
        **bm.engine_options(args, ENGINE_OPTIONS),
        max_model_len=longest,
        num_blocks=num_blocks,
        collective=args.collective,
        max_logprobs=0,
        seed=args.seed,
        command_buffers=not args.no_command_buffers,
        trim_to_bucket=not args.no_trim_to_bucket,
        attention=args.attention,
    )
    runs: dict[str, dict[str, dict[str, Any]]] = {w: {} for w in args.workloads}
    warmups: dict[str, dict[str, Any]] = {}
    first = requests[args.workloads[0]][:8]
    for schedule in args.schedules:
        for policy in args.policies:
            name = f"{schedule} {policy}"
            fields = {**engine_config.__dict__, "schedule": schedule, **POLICIES[policy]}
            engine = LLMEngine(model, EngineConfig(**fields))
            start = time.perf_counter()
            report = engine.warmup(progress=True)
            serve(engine, first, "all-at-once", f"warm-up {name}")  # first runs
            warmups[name] = {
                "layouts": report.layouts,
                "loaded": report.loaded,
                "compiled": report.compiled,
                "warmup_s": report.seconds,
                "seconds": time.perf_counter() - start,
                "compilation_cache_dir": engine.config.compilation_cache_dir,
            }
            print(
                f"{name}: {report.layouts} step layouts ({report.loaded} loaded from the "
                f"executable cache, {report.compiled} compiled) in {report.seconds:.1f}s, warmed "
                f"up in {warmups[name]['seconds']:.1f}s (compilation cache: "
                f"{engine.config.compilation_cache_dir})",
                file=sys.stderr,
            )
            for workload in args.workloads:
                engine.reset_prefix_cache()  # no run starts with another's cached blocks
                r = serve(engine, requests[workload], workload, f"{workload} {name}")
                if rates:
                    r["floor"] = serve_floor.run_floor(
                        config, tp, itemsize, requests[workload], r, **rates
                    )
                runs[workload].setdefault(schedule, {})[policy] = r
                print(f"{workload} {name}: {_line(r)}", file=sys.stderr)
            del engine
            gc.collect()
            jax.clear_caches()
    return {
        "model": model_name,
        "layers": args.layers,
        "tp": tp,
        "engine": {k: v for k, v in engine_config.__dict__.items() if k != "tuning"},
        "kv_sizing": sizing,
        "policies": {p: POLICIES[p] for p in args.policies},
        "runs": runs,
        "warmup": warmups,
        "rates": rates,
        **serve_report.ratios(runs),
    }


def measure_rates(device: Any, model: Any) -> dict[str, float] | None:
    """``device``'s matmul rate (TFLOP/s, the model's dtype) and copy bandwidth (GB/s, read +
    write) for the runs' floors (``serve_floor``), as ``decode_bench.py`` measures them; None
    (and a line on stderr) where measuring fails."""
    rf = serve_floor.roofline
    try:
        gb_s = rf.copy_bandwidth(device, int(2 * rf.GB))["gb_s"]
        tflop_s = rf.matmul_rate(device, model.embed.get_value().dtype)["tflop_s"]
    except Exception as err:  # e.g. out of memory beside XLA's pool: the runs go on
        print(f"no floors: measuring the rates failed: {err!r}", file=sys.stderr)
        return None
    print(f"copy bandwidth {gb_s:.0f} GB/s, matmul rate {tflop_s:.0f} TFLOP/s", file=sys.stderr)
    return {"tflop_s": tflop_s, "gb_s": gb_s}


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['total_tok_s']:.1f} total tok/s, {r['output_tok_s']:.1f} out tok/s, TTFT p50 "
        f"{r['ttft_p50_ms'] or 0:.1f} ms, TPOT p50 {r['tpot_p50_ms'] or 0:.2f} ms, {r['steps']} "
        f"steps ({r['split_steps']} woven), {r['preemptions']} preemptions, "
        f"{r['prefix_cache_hits']} prefix-cache hit tokens, {r['peak_running']} running at "
        f"most, {r['failed']} failed, {r['compilations']} compilations"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the engines on the workloads and write the outputs; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    platform, devices = bm.start_devices()
    report = run(args, devices, platform)
    report["environment"] = bm.environment(devices, ["benchmarks/serve_bench.py", *argv])
    report["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = serve_report.to_markdown(report)
    (args.out / "serve.md").write_text(markdown + "\n")
    if not args.no_plot:
        serve_report.write_plot(report, args.out / "serve.png")
    print(markdown)
    if platform == "cpu":
        print(bm.CPU_NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
