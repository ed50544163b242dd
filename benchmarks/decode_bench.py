"""The serving engine's decode step against the memory roofline.

A model of named shapes (``--model``, default Llama-3-8B, all its layers unless ``--layers``)
with random weights, tensor-parallel over ``--tp`` devices, served by
``jax_tokenweave.serving.LLMEngine``. For each ``--batch`` x ``--context``: an engine sized for
it gets ``batch`` requests of ``context`` random prompt tokens, steps until every prompt is in
the cache (each step layout met on the way compiles once), runs ``--warm-steps`` decode steps
(the decode layout compiles in the first), then times ``--steps`` consecutive ``engine.step()``
calls, each a pure decode step of all requests (wall clock: scheduling, packing, the jitted step
and reading its tokens back). Over those and the profiled steps, ``nvidia-smi`` samples the SM
clock and power every 50 ms (``gpu_clocks.py``: a step held to the GPU's power limit runs at a
lower clock). Compilations in the timed window are counted (``serving.
count_compilations``) and must be zero.

Roofline: a decode step must read every weight once (the embedding table is a few gathered rows;
a tied LM head counts it once) and every request's K/V of every layer: ``weights + sum over
requests of keys x KVH/TP x D x bytes x 2 (K, V) x layers`` per GPU, ``keys`` the request's
cached positions at that step. Bandwidth: a device-to-device copy in the same run (bytes read +
written / time). Roofline time = bytes / bandwidth; ratio = step time (median) / roofline time.
Serial floor (``roofline.serial_floor_ms``): the layer's parts one after another, each GEMM at
the slower of its weight bytes and its FLOPs at a matmul rate measured in the same run (an
8192-cube product), plus the K/V bytes. At large batches the GEMMs are bound by FLOPs, and a
step's dependences (attention waits for QKV, the MLP for attention) keep them from overlapping
the K/V reads: the floor then sits above the bytes roofline.

Writes ``decode.json``, ``decode.md`` and ``decode.png`` into ``--out``. With no GPU it runs the
tiny config and small batches (under a minute; CPU timings say nothing about GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
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

ENGINE_OPTIONS = ("block_size", "prefill_tile", "key_chunk", "max_num_batched_tokens")
DEFAULTS = {
    "gpu": dict(model="llama3-8b", batch=[1, 64, 256], context=[1024], steps=32, copy_gb=2.0),
    "cpu": dict(model="tiny", batch=[1, 4], context=[64], steps=8, copy_gb=0.1),
}


def sibling(name: str) -> Any:
    """``benchmarks/<name>.py`` (``benchmarking.sibling_module``)."""
    return bm.sibling_module(__file__, name)


def roofline() -> Any:
    """``benchmarks/roofline.py``."""
    return sibling("roofline")


def add_model_options(
    p: argparse.ArgumentParser, engine: Sequence[str] = ENGINE_OPTIONS, plot: bool = True
) -> None:
    """The model and engine options ``decode_bench.py`` and ``prefill_bench.py`` share."""
    p.set_defaults(layers=None)
    p.add_argument(
        "--model",
        help=f"model config name, {bm.config_names_help()} (default: "
        "llama3-8b on GPUs, tiny on CPUs)",
    )
    p.add_argument("--tp", type=bm.positive_int, default=1, help="tensor-parallel degree")
    p.add_argument(
        "--dtype",
        choices=tuple(bm.DTYPES),
        default="bfloat16",
        help="parameter, activation and cache dtype",
    )
    p.add_argument(
        "--schedule",
        choices=("auto", "weave", "baseline"),
        default="auto",
        help="the engine's schedule (auto: EngineConfig's default, weave, at every TP: at TP 1 "
        "it runs each add + RMSNorm as the fused one-rank kernel where the extension is built)",
    )
    bm.add_collective_option(p, "auto", "weave's reductions")
    p.add_argument(
        "--split-threshold",
        type=bm.positive_int,
        help="weave: split steps of at least this many rows (EngineConfig.split_threshold; "
        "default: the tuning table's)",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTION_IMPLS,
        default="auto",
        help="the engine's paged attention (EngineConfig.attention)",
    )
    p.add_argument(
        "--sync",
        action="store_true",
        help="the synchronous engine (EngineConfig.async_scheduling=False)",
    )
    p.add_argument(
        "--no-command-buffers",
        action="store_true",
        help="decode steps without XLA command buffers (EngineConfig.command_buffers=False)",
    )
    bm.add_engine_options(p, engine)
    p.add_argument(
        "--copy-gb",
        type=bm.positive_float,
        help="bytes of the bandwidth copy, GB (default: 2 on GPUs, 0.1 on CPUs)",
    )
    p.add_argument("--seed", type=bm.nonnegative_int, default=0, help="weights and prompts seed")
    if plot:
        p.add_argument(
            "--no-plot",
            action="store_true",
            help="write no plot (the plot needs matplotlib: the plot extra)",
        )


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; see ``--help``."""
    p = bm.result_parser("decode_bench.py", __doc__, "decode")
    add_model_options(p)
    p.add_argument(
        "--batch",
        type=bm.positive_ints,
        nargs="+",
        action=bm.Flatten,
        help="requests decoding together (default: 1 64 256 on GPUs, 1 4 on CPUs)",
    )
    p.add_argument(
        "--context",
        type=bm.positive_ints,
        nargs="+",
        action=bm.Flatten,
        help="prompt tokens per request (default: 1024 on GPUs, 64 on CPUs)",
    )
    p.add_argument(
        "--steps", type=bm.positive_int, help="timed decode steps (default: 32 on GPUs, 8 on CPUs)"
    )
    p.add_argument(
        "--warm-steps",
        type=bm.positive_int,
        default=3,
        help="untimed decode steps first (the first compiles the decode layout)",
    )
    p.add_argument(
        "--profile-steps",
        type=bm.nonnegative_int,
        default=20,
        help="decode steps profiled after the timed ones (PyTorch's CUDA profiler: "
        "device-busy time, host gaps, top kernels; 0: none). The first profiled step starts "
        "on an idle GPU (the profiler's start outlasts the step in flight), which shows as one "
        "gap of several ms: over 2-5 steps that reads as a host gap that steady steps lack",
    )
    p.add_argument(
        "--no-host-profile",
        action="store_true",
        help="profile the steps without cProfile (it slows the host, so the GPU may idle more)",
    )
    p.add_argument(
        "--penalties",
        action="store_true",
        help="every request with vLLM's presence, frequency and repetition penalties, each its "
        "own values (drawn from --seed): the steps run the processed sampler",
    )
    return p


def parse_args(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """Parse and check the options (``parser.error`` before any work on bad ones)."""
    p = parser or build_parser()
    args = p.parse_args(argv)
    from jax_tokenweave.models.configs import get_config

    if args.model is not None:
        try:
            get_config(args.model)
        except ValueError as err:
            p.error(f"--model: {err}")
    if args.key_chunk % args.block_size:
        p.error(f"--key-chunk {args.key_chunk} is not a multiple of --block-size {args.block_size}")
    budget = getattr(args, "max_num_batched_tokens", None)
    if budget and budget % args.prefill_tile:
        p.error(
            f"--max-num-batched-tokens {budget} is not a multiple of --prefill-tile "
            f"{args.prefill_tile}"
        )
    if not getattr(args, "no_plot", True) and (hint := bm.matplotlib_missing()):
        p.error(f"the plot {hint} (or pass --no-plot)")
    return args


def resolve(args: argparse.Namespace, platform: str) -> argparse.Namespace:
    """``args`` with the platform's defaults filled in (``None`` options only)."""
    a = argparse.Namespace(**vars(args))
    for name, value in DEFAULTS["gpu" if platform == "gpu" else "cpu"].items():
        if getattr(a, name, None) is None:
            setattr(a, name, value)
    if a.schedule == "auto":
        from jax_tokenweave.serving import EngineConfig

        a.schedule = EngineConfig.schedule  # what a user's engine runs
    return a


def build_model(a: argparse.Namespace, devices: Sequence[Any]) -> Any:
    """The named model with random weights (``nnx.Rngs(seed)``) over the first ``tp`` devices."""
    from flax import nnx

    from jax_tokenweave.models.llama import LlamaModel

    config = bm.load_config(a.model, a.layers)
    mesh = bm.make_mesh(devices, a.tp)
    return LlamaModel(config, mesh, dtype=bm.DTYPES[a.dtype], rngs=nnx.Rngs(a.seed))


def engine_config(a: argparse.Namespace, requests: int, positions: int) -> Any:
    """An ``EngineConfig`` for ``requests`` running at once, each up to ``positions``."""
    from jax_tokenweave.serving import EngineConfig
    from jax_tokenweave.serving.buckets import decode_rows

    tile = a.prefill_tile
    budget = max(a.max_num_batched_tokens, decode_rows(requests, tile) + tile)
    per_request = ceil_div(positions, a.block_size)
    return EngineConfig(
        max_num_batched_tokens=ceil_div(budget, tile) * tile,
        max_num_seqs=requests,
        max_model_len=positions + 1,
        block_size=a.block_size,
        num_blocks=requests * per_request + 1,
        prefill_tile=tile,
        key_chunk=a.key_chunk,
        schedule=a.schedule,
        collective=a.collective,
        split_threshold=a.split_threshold,
        attention=a.attention,
        max_logprobs=0,
        seed=a.seed,
        async_scheduling=not a.sync,
        command_buffers=not a.no_command_buffers,
    )


def run_point(
    model: Any, a: argparse.Namespace, batch: int, context: int, rng: np.random.Generator
) -> dict[str, Any]:
    """Prefill ``batch`` prompts of ``context`` tokens, warm up, time the decode steps."""
    from jax_tokenweave.serving import LLMEngine, SamplingParams, count_compilations

    # Requests finish prefill up to one step apart each (chunked prefill), and the earliest
    # decode meanwhile: room for every step of the run, so none finishes in the timed window.
    max_tokens = a.warm_steps + a.steps + a.profile_steps + batch + 2
    engine = LLMEngine(model, engine_config(a, batch, context + max_tokens))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(batch):
        if a.penalties:  # each request its own values: no compilation per value
            presence, frequency = rng.uniform(-2, 2, 2)
            params = dataclasses.replace(
                params,
                presence_penalty=float(presence),
                frequency_penalty=float(frequency),
                repetition_penalty=float(rng.uniform(0.5, 2.0)),
            )
        engine.add_request(rng.integers(0, model.config.vocab_size, context).tolist(), params)
    sched = engine.scheduler
    start, prefill_steps = time.perf_counter(), 0
    while sched.waiting or not all(s.prefilled for s in sched.running):
        engine.step()
        prefill_steps += 1
    prefill_s = time.perf_counter() - start
    times, keys = [], []
    with sibling("gpu_clocks").ClockSampler() as clocks:
        for _ in range(a.warm_steps):
            engine.step()
        window = clocks.mark()
        with count_compilations() as compiles:
            for _ in range(a.steps):
                keys.append(sum(s.num_computed + 1 for s in sched.running))
                t0 = time.perf_counter()
                gained = engine.step()
                times.append(time.perf_counter() - t0)
                if len(gained) != batch:
                    got = f"a timed step gave {len(gained)} tokens"
                    raise RuntimeError(f"{got} for {batch} requests")
        profile = (
            sibling("step_profile").profile_steps(
                engine.step, a.profile_steps, host_profile=not a.no_host_profile
            )
            if a.profile_steps
            else {"status": "skipped", "reason": "--profile-steps 0"}
        )
        gpu = clocks.summary(window, clocks.mark())
    layout = batch_layout(engine, batch)
    del engine
    gc.collect()
    ms = np.asarray(times) * 1e3
    return {
        "batch": batch,
        "context": context,
        "status": "ok",
        "penalties": a.penalties,
        "steps": a.steps,
        "step_p50_ms": float(np.median(ms)),
        "step_p90_ms": float(np.percentile(ms, 90)),
        "step_mean_ms": float(ms.mean()),
        "tok_s": batch / (np.median(ms) * 1e-3),
        "tok_s_total": batch * a.steps / (ms.sum() * 1e-3),
        "mean_keys": float(np.mean(keys)),
        "compilations": compiles.count,
        "prefill_steps": prefill_steps,
        "prefill_s": prefill_s,
        "layout": layout,
        "profile": profile,
        "gpu_clocks": gpu,
    }


def batch_layout(engine: Any, batch: int) -> dict[str, Any]:
    """The decode step's layout (rows, whether split) and the attention it resolves to."""
    from jax_tokenweave.serving.buckets import decode_rows
    from jax_tokenweave.serving.runner.batch import make_layout

    cfg = engine.config
    rows = decode_rows(batch, cfg.prefill_tile)
    layout = make_layout(rows, rows, cfg, engine.model_config, engine.tp)
    return {"rows": rows, "split": layout.plan.is_split, "attention": engine.runner.attention()}


def run(a: argparse.Namespace, devices: Sequence[Any]) -> dict[str, Any]:
    """The bandwidth, the model, every (batch, context) point."""
    from jax_tokenweave.harness.modes import one_line

    rf = roofline()
    bandwidth = rf.copy_bandwidth(devices[0], int(a.copy_gb * rf.GB))
    print(f"copy bandwidth: {bandwidth['gb_s']:.0f} GB/s", file=sys.stderr)
    model = build_model(a, devices)
    matmul = rf.matmul_rate(devices[0], model.embed.get_value().dtype)
    print(f"matmul rate: {matmul['tflop_s']:.0f} TFLOP/s", file=sys.stderr)
    weights = rf.weight_bytes(model, devices[0])
    rng = np.random.default_rng(a.seed)
    records = []
    for batch, context in tqdm([(b, c) for b in a.batch for c in a.context], desc="decode"):
        try:
            record = run_point(model, a, batch, context, rng)
            rf.add_decode_roofline(record, model, weights, bandwidth["gb_s"], matmul["tflop_s"])
        except Exception as err:  # one failing point must not end the sweep
            record = {
                "batch": batch,
                "context": context,
                "status": "error",
                "reason": one_line(err),
            }
        tqdm.write(_line(record))
        if record.get("profile", {}).get("host_profile"):
            print(record["profile"]["host_profile"], file=sys.stderr)
            print(json.dumps(record["profile"]["idle_gaps"], indent=1), file=sys.stderr)
        records.append(record)
    return {
        "model": a.model,
        "layers": model.config.num_layers,
        "tp": a.tp,
        "bandwidth": bandwidth,
        "matmul": matmul,
        "weight_bytes": weights,
        "records": records,
    }


def _line(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"batch {r['batch']} context {r['context']}: {r['status']}: {r['reason']}"
    prof = r.get("profile", {})
    busy = (
        f"; profiled: GPU busy {prof['busy_ms']:.2f} ms, host gap {prof['gap_ms']:.2f} ms per step"
        if prof.get("status") == "ok"
        else ""
    )
    return (
        f"batch {r['batch']} context {r['context']}: step {r['step_p50_ms']:.2f} ms "
        f"(roofline {r['roofline_ms']:.2f} ms, x{r['ratio']:.2f}), {r['tok_s']:.0f} tok/s, "
        f"{r['compilations']} compilations{busy}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep and write the outputs; 1 where a point failed or compiled while timed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    platform, devices = bm.start_devices(max(args.tp, 1))
    a = resolve(args, platform)
    report = run(a, devices)
    report["environment"] = bm.environment(devices[: a.tp], ["benchmarks/decode_bench.py", *argv])
    report["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    out = sibling("decode_report")
    out.write_outputs(
        report, a.out, "decode", out.to_markdown(report), None if a.no_plot else out.write_plot
    )
    if platform == "cpu":
        print(bm.CPU_NOTE)
    bad = [r for r in report["records"] if r["status"] != "ok" or r["compilations"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
