"""Probe (CPU, no model): what the step buckets cost a served workload.

Replays a ``serve_bench.py`` workload (its seeded requests, ended by the client at their
``output_len``) through the engine's own ``Scheduler`` and step buckets, one token per sampled
request per step, as a synchronous engine would; per step the real rows and the layout's rows.
Reports the steps, rows real and padded, the layouts used, and the GEMMs' per-step floor (each
step at the slower of its rows' FLOPs and a weight read, ``serve_floor.py``'s rates) with real
and with padded rows (``--no-trim-to-bucket``: as an engine that pads every step up to its
bucket). ``--mixed-multiple M``: what if a step with prompt chunks rounded its rows
up to a multiple of M past M, instead of to a power of two. TP 1, dense configs.

    python3 -P benchmarks/probes/step_padding_probe.py --workloads chat --num-requests 2000 \
        --max-num-seqs 512 --model llama3-8b --layers 32 --num-blocks 41813 \
        --tflop-s 796 --gb-s 4132
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import numpy as np

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.serving import EngineConfig, SamplingParams
from jax_tokenweave.serving.runner.batch import step_shape
from jax_tokenweave.serving.scheduling.request_state import Request
from jax_tokenweave.serving.scheduling.scheduler import Scheduler

BENCH = Path(__file__).resolve().parents[1] / "serve_bench.py"
serve_bench = bm.sibling_module(str(BENCH), "serve_bench")
serve_floor = bm.sibling_module(str(BENCH), "serve_floor")


def layout_rows(step: Any, cfg: EngineConfig, mixed_multiple: int) -> tuple[int, int]:
    """(decode rows, rows) of ``step``'s layout (``serving.runner.batch.step_shape``), or with
    ``mixed_multiple``, a step with chunks past that many rows rounded to a multiple of it."""
    tile = cfg.prefill_tile
    chunk_rows = sum(ceil_div(c.length, tile) * tile for c in step.chunks)
    decode, rows = step_shape(len(step.decodes), chunk_rows, cfg)
    want = decode + chunk_rows
    if chunk_rows and mixed_multiple and want > mixed_multiple:
        rows = min(ceil_div(want, mixed_multiple) * mixed_multiple, cfg.max_num_batched_tokens)
    return decode, rows


def replay(args: Any, mixed_multiple: int) -> dict[str, Any]:
    """Every step of the workload: its real and padded rows; the layouts used."""
    config = bm.load_config(args.model, args.layers)
    requests = serve_bench.make_requests(args, config.vocab_size)[args.workloads[0]]
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
    policy = serve_bench.POLICIES[args.policies[0]]
    cfg = EngineConfig(
        **bm.engine_options(args, serve_bench.ENGINE_OPTIONS),
        max_model_len=longest,
        num_blocks=args.num_blocks,
        trim_to_bucket=not args.no_trim_to_bucket,
        **policy,
    )
    scheduler, target = Scheduler(cfg), {}
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True)
        seq = Request(str(i), [int(t) for t in r["prompt"]], params, 0, frozenset())
        target[seq.request_id] = r["output_len"]
        scheduler.add(seq)
    real, padded, layouts = [], [], collections.Counter()
    while scheduler.has_unfinished():
        step = scheduler.schedule()
        if step.empty:
            raise RuntimeError("the scheduler made an empty step with requests unfinished")
        layout = layout_rows(step, cfg, mixed_multiple)
        real.append(len(step.decodes) + sum(c.length for c in step.chunks))
        padded.append(layout[1])
        layouts[layout] += 1
        scheduler.update(step, [1] * len(step.sampled))
        for seq in step.sampled:
            if not seq.finished and len(seq.output) >= target[seq.request_id]:
                scheduler.finish(seq, "abort")
    return {
        "config": config,
        "real": np.array(real),
        "padded": np.array(padded),
        "layouts": layouts,
        "preemptions": scheduler.kv.stats.preemptions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = serve_bench.build_parser()
    parser.add_argument("--tflop-s", type=float, default=796.0, help="matmul rate")
    parser.add_argument("--gb-s", type=float, default=4132.0, help="copy bandwidth")
    parser.add_argument("--mixed-multiple", type=int, default=0, help="what-if bucket (rows)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(["--out", "unused", *argv])
    if not args.num_blocks:
        parser.error("--num-blocks: the KV pool to replay against (serve.json's engine.num_blocks)")
    out = replay(args, args.mixed_multiple)
    c, itemsize = out["config"], np.dtype(bm.DTYPES[args.dtype]).itemsize
    flop_s = 2 * serve_floor.gemm_params(c, 1) / (args.tflop_s * 1e12)  # seconds a row
    weights_s = serve_floor.weight_bytes(c, 1, itemsize) / (args.gb_s * 1e9)
    real, padded = out["real"], out["padded"]
    print(
        f"{len(real)} steps, {out['preemptions']} preemptions; rows real {real.sum()}, padded "
        f"{padded.sum()} ({padded.sum() / real.sum():.2f}x); {len(out['layouts'])} layouts used"
    )
    for name, rows in (("real", real), ("padded", padded)):
        floor = np.maximum(rows * flop_s, weights_s).sum()
        print(f"GEMMs' per-step floor, {name} rows: {floor:.1f} s")
    print("most used (decode rows, rows): steps:", out["layouts"].most_common(10))
    return 0


if __name__ == "__main__":
    sys.exit(main())
