"""End-to-end benchmark: prefill and decode-batch latency of the decoder stack, per mode.

Modes are named as everywhere in this project (``jax_tokenweave.harness.benchmarking``): the
schedule, and for ``weave`` the collective that does its reductions, plus ``-nosplit`` where the
batch is kept whole. Prefill modes (``MODES``), each the layer stack on a packed batch of requests:

- ``baseline``: XLA ``psum`` all-reduce, replicated residual (what a plain JAX TP model does);
- ``weave-ffi-nosplit``: the weave schedule with the fused kernel but no token split;
- ``weave-xla``: the weave schedule with XLA ReduceScatter -> norm -> AllGather;
- ``weave-ffi``: the weave schedule with the fused CUDA kernel (TokenWeave proper);
- ``nocomm``: every collective dropped (not the model's output; the floor).

The weave modes split where the shipped tuning table says (at TP=2 from 4096 tokens; see
``jax_tokenweave.weave.tuning``) and use its CTA counts: what the library does by default. To see
the split's own costs at every size, ``benchmarks/breakdown.py`` forces the split.

Decode batches (``DECODE_MODES``: ``baseline``, ``weave-ffi``, ``weave-ffi-sync``, ``weave-xla``,
``nocomm``) are ``n`` requests of one token each (below the split threshold, so never split;
``weave-ffi`` runs the fused kernel with the residual replicated where it fits, ``weave-ffi-sync``
with it token-sharded): the layer stack without a KV cache, i.e. the GEMMs and the communication of
one decode step (attention over past tokens is not included). Modes that compute the model are
checked against baseline (the dtype's tolerance); for MoE models against a float32 copy of the
weights instead (``harness.modes.float32_copy``: a router's top-k flips on bf16 near ties, so two
valid bf16 runs differ by more than rounding). Modes that cannot run here (no CUDA extension, too
few devices) are reported as skipped with the reason. ``--time-budget`` bounds the run: work not
started by then is reported as skipped. With no GPU it runs on 8 virtual CPU devices, whose
timings say nothing about GPU overlap.

Writes ``e2e.json``, ``e2e.md`` and ``e2e.png`` (unless ``--no-plot``) into ``--out``.
Example (4 GPUs)::

    python benchmarks/e2e_bench.py --out results/ --models llama3-70b --tp 4 2
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.harness.modes import Mode, float32_copy, float32_output, measure
from jax_tokenweave.kernel import unavailable_reason

_step_profile = bm.sibling_module(__file__, "step_profile")  # busy_ms (found under -P)

MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("baseline"),
        Mode("weave", "ffi", split=False),
        Mode("weave", "xla"),
        Mode("weave", "ffi"),
        Mode("nocomm"),
    )
}
DECODE_MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("baseline"),
        Mode("weave", "ffi"),
        Mode("weave", "ffi-sync"),
        Mode("weave", "xla"),
        Mode("nocomm"),
    )
}
MODELS = ("llama3-70b", "qwen2.5-72b", "mixtral-8x22b")
TOKENS = (1024, 2048, 4096, 8192, 16384)
DECODE_TOKENS = (1, 8, 32, 64, 128, 256)
TPS = (2, 4)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; see ``--help``."""
    p = bm.result_parser("e2e_bench.py", __doc__, "e2e")
    p.add_argument(
        "--models",
        nargs="+",
        default=list(MODELS),
        metavar="MODEL",
        help=f"model config names, {bm.config_names_help()}",
    )
    p.add_argument(
        "--tp",
        type=bm.positive_ints,
        nargs="+",
        action=bm.Flatten,
        default=list(TPS),
        help="tensor-parallel degrees, run in this order",
    )
    p.add_argument(
        "--tokens",
        type=bm.positive_ints,
        nargs="+",
        action=bm.Flatten,
        default=list(TOKENS),
        help="prefill batch sizes in tokens",
    )
    p.add_argument(
        "--request-len", type=bm.positive_int, default=1024, help="tokens per prefill request"
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=list(MODES),
        metavar="MODE",
        help="prefill modes to run",
    )
    p.add_argument(
        "--decode-tokens",
        type=bm.positive_ints,
        nargs="+",
        action=bm.Flatten,
        default=list(DECODE_TOKENS),
        help="decode batch sizes (one token per request)",
    )
    p.add_argument(
        "--decode-modes",
        nargs="+",
        default=list(DECODE_MODES),
        choices=list(DECODE_MODES),
        metavar="MODE",
        help="decode modes to run",
    )
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill sweep")
    p.add_argument("--no-decode", action="store_true", help="skip the decode sweep")
    bm.add_run_options(p, warmup=2, iters=10, unit="mode and batch")
    p.add_argument(
        "--device-time",
        type=int,
        default=0,
        metavar="N",
        help="also profile N runs per mode and batch for device-busy ms (PyTorch's CUDA "
        "profiler, median over GPUs), beside the wall ms, which include the host's dispatch "
        "(0: off)",
    )
    p.add_argument(
        "--dispatch-ahead",
        type=bm.positive_int,
        default=1,
        metavar="K",
        help="runs dispatched back to back per timed sample, then waited for, as a server "
        "dispatches steps (1: wait for each run; the device time is profiled the same way)",
    )
    bm.add_sweep_options(p, plot="e2e.png")
    p.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="only redraw the markdown and plot from an earlier e2e.json",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the options (``parser.error`` before any work on bad ones)."""
    p = build_parser()
    args = p.parse_args(argv)
    from jax_tokenweave.models.configs import get_config

    for model in args.models:
        try:
            get_config(model)
        except ValueError as err:
            p.error(f"--models: unknown model {model!r}: {err}")
    if args.device_time < 0:
        p.error(f"--device-time must be >= 0, got {args.device_time}")
    if not args.no_plot and (hint := bm.matplotlib_missing()):
        p.error(f"the plot {hint} (or pass --no-plot)")
    return args


class Runner:
    """Measures modes for one (model, TP) decoder and appends records to ``self.records``."""

    def __init__(self, args: argparse.Namespace, devices: Sequence[jax.Device]) -> None:
        self.args, self.devices = args, devices
        self.dtype = bm.DTYPES[args.dtype]
        self.tol = bm.TOLERANCE[args.dtype]
        self.seed = args.seed if args.seed is not None else bm.resolve_seed()
        self.start = time.perf_counter()
        self.records: list[dict[str, Any]] = []
        n, ahead = args.device_time, args.dispatch_ahead
        self.device_time = (lambda run: _step_profile.busy_ms(run, n, ahead)) if n > 0 else None

    def out_of_time(self) -> bool:
        budget = self.args.time_budget
        return budget is not None and time.perf_counter() - self.start > budget

    def skip(self, base: dict[str, Any], modes: Sequence[str], reason: str) -> None:
        for mode in modes:
            self.records.append({**base, "mode": mode, "status": "skipped", "reason": reason})

    def run_all(self) -> None:
        """The sweep: per TP, per model, the prefill token counts then the decode batches."""
        a = self.args
        for tp in a.tp:
            for model in a.models:
                work = []
                if not a.no_prefill:
                    work += [("prefill", t, MODES, a.modes, a.request_len) for t in a.tokens]
                if not a.no_decode:
                    work += [
                        ("decode", t, DECODE_MODES, a.decode_modes, 1) for t in a.decode_tokens
                    ]
                self.run_model(model, tp, work)

    def run_model(self, model: str, tp: int, work: list[tuple]) -> None:
        config = bm.load_config(model, self.args.layers)
        reason = None
        if tp > len(self.devices):
            reason = f"TP={tp} needs {tp} devices, this machine has {len(self.devices)}"
        else:
            try:
                config.check_tensor_parallel(tp)
            except ValueError as err:
                reason = str(err)
        if reason is None and self.out_of_time():
            reason = "time budget exhausted"
        if reason is not None:
            for kind, tokens, _, modes, _ in work:
                self.skip(_base(kind, model, tp, tokens), modes, reason)
            return
        mesh = bm.make_mesh(self.devices, tp)
        print(f"== {model} x{config.num_layers} layers, TP={tp}", flush=True)
        decoder = bm.build_decoder(config, mesh, self.dtype, self.seed)
        try:
            references = self.float32_outputs(model, config, mesh, decoder, work)
            for i, (kind, tokens, table, modes, request_len) in enumerate(work):
                base = _base(kind, model, tp, tokens)
                if self.out_of_time():
                    self.skip(base, modes, "time budget exhausted")
                    continue
                print(f"   {kind} {model} TP={tp} T={tokens}: {', '.join(modes)}", flush=True)
                lengths, hidden = self.batch(config, mesh, tokens, request_len, i)
                info = measure(
                    decoder,
                    config,
                    model,
                    lengths,
                    hidden,
                    {name: table[name] for name in modes},
                    tol=self.tol,
                    warmup=self.args.warmup,
                    iters=self.args.iters,
                    ffi_reason=unavailable_reason(
                        mesh, "tp", self.dtype, (tokens, config.hidden_size)
                    ),
                    reference=references.get(i),
                    device_time=self.device_time,
                    ahead=self.args.dispatch_ahead,
                )
                self.records += [{**base, "mode": name, **info[name]} for name in modes]
        finally:
            del decoder
            gc.collect()
            jax.clear_caches()

    def batch(self, config: Any, mesh: Any, tokens: int, request_len: int, index: int) -> tuple:
        """The request lengths and the random hidden [T, H] of point ``index``."""
        hidden = bm.random_hidden(
            tokens, config.hidden_size, self.dtype, mesh, self.seed + 1 + index
        )
        return bm.request_lengths(tokens, request_len), hidden

    def float32_outputs(
        self, model: str, config: Any, mesh: Any, decoder: Any, work: list[tuple]
    ) -> dict:
        """MoE models (a router's top-k flips on bf16 near ties): each point's float32 baseline
        output, from a float32 copy of the weights dropped before any timing; else none."""
        if not config.num_experts or self.tol <= 1e-4:
            return {}
        print("   float32 references (MoE)", flush=True)
        reference, outputs = float32_copy(decoder), {}
        try:
            for i, (_, tokens, _, _, request_len) in enumerate(work):
                if not self.out_of_time():
                    lengths, hidden = self.batch(config, mesh, tokens, request_len, i)
                    outputs[i] = float32_output(reference, config, model, lengths, hidden)
        finally:
            del reference
            gc.collect()
            jax.clear_caches()
        return outputs


def _base(kind: str, model: str, tp: int, tokens: int) -> dict[str, Any]:
    return {"kind": kind, "model": model, "tp": tp, "tokens": tokens}


def e2e_report() -> Any:
    """``benchmarks/e2e_report.py``: the markdown, the plot and the output files."""
    return bm.sibling_module(__file__, "e2e_report")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep (or ``--replot``) and write the outputs; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.replot:
        report = json.loads(args.replot.read_text())
        e2e_report().write_outputs(report, args.out, plot=not args.no_plot)
        return 0
    platform, devices = bm.start_devices()
    runner = Runner(args, devices)
    # A `timeout` kill (SIGTERM) still writes what was measured: SystemExit runs `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        runner.run_all()
    finally:
        env = bm.environment(devices, ["benchmarks/e2e_bench.py", *argv])
        config = {k: v for k, v in vars(args).items() if k not in ("out", "replot", "no_plot")}
        config.update(
            seed=runner.seed,
            tolerance=runner.tol,
            wall_s=round(time.perf_counter() - runner.start, 1),
        )
        report = {"environment": env, "config": config, "records": runner.records}
        if bm.is_lead():  # one process per device: the first one writes
            e2e_report().write_outputs(report, args.out, plot=not args.no_plot)
    counts: dict[str, int] = {}
    for r in runner.records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print("records: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    print(e2e_report().to_markdown(report))
    if platform == "cpu":
        print(bm.CPU_NOTE)
    return 1 if counts.get("mismatch") else 0


if __name__ == "__main__":
    sys.exit(main())
