"""HTTP serving benchmark: N concurrent streaming clients against the OpenAI-compatible server,
next to the same workload through the in-process engine.

The workload (seeded): ``--num-requests`` requests of random token-id prompts (lengths uniform
in ``--prompt-len MIN MAX``) and output lengths uniform in ``--output-len MIN MAX`` (greedy,
``ignore_eos``: every request runs to its length). ``--clients`` clients each take the next
request as soon as their previous one ends (a closed loop of that concurrency):

- ``http``: asyncio + httpx clients streaming ``POST /v1/completions`` (server-sent events, one
  chunk per token) from a server started here as a subprocess (``python -m
  jax_tokenweave.serve``, every step program compiled before it listens), or one already
  running (``--url``); TTFT and TPOT as the clients see them;
- ``inprocess``: the same requests through ``LLM``'s engine in this process, the same closed
  loop of ``--clients`` requests in flight (after the server has exited, so both never share
  the accelerator's memory; with ``--url`` pass ``--no-inprocess`` where they would).

The model: ``--model`` a checkpoint directory / cached Hugging Face id, or ``--random NAME`` a
named config with random weights (default: ``llama3-8b`` on GPUs, ``tiny`` with one layer on
CPUs). Each run serves an untimed round of ``--clients`` requests first. Reported per run:
output and total tokens/s, requests/s, TTFT and TPOT p50 / p99, and HTTP / in-process output
throughput. Writes ``http.json`` and ``http.md`` into ``--out``; the server's log goes to
``--server-log`` (default: a file in the temporary folder, never ``--out``). The server and the
streaming clients live in ``http_client.py``.

On one GPU (Llama-3-8B shapes, random weights, TP 1, 64 clients)::

    python benchmarks/http_bench.py --out /tmp/http
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.kernel._util import ceil_div

ENGINE_OPTIONS = ("max_num_batched_tokens", "prefill_tile", "block_size", "key_chunk")
DEFAULTS = {
    "gpu": dict(
        random="llama3-8b",
        clients=64,
        num_requests=256,
        prompt_len=[128, 1024],
        output_len=[128, 512],
        dtype="bfloat16",
    ),
    "cpu": dict(
        random="tiny",
        layers=1,
        clients=4,
        num_requests=8,
        prompt_len=[4, 24],
        output_len=[2, 8],
        dtype="float32",
        max_num_batched_tokens=64,
        prefill_tile=16,
        key_chunk=64,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; see ``--help``."""
    p = argparse.ArgumentParser(
        prog="http_bench.py", description=__doc__.split("\n\n")[0], formatter_class=bm.HelpFormatter
    )
    p.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="folder for http.json and http.md"
    )
    p.add_argument("--model", help="checkpoint directory or cached Hugging Face model id")
    p.add_argument(
        "--random",
        metavar="NAME",
        help="a named config with random weights "
        f"({bm.config_names_help()}; default: llama3-8b on GPUs, tiny on CPUs)",
    )
    p.add_argument("--layers", type=bm.positive_int, help="--random: decoder layers")
    p.add_argument(
        "--platform",
        choices=("auto", "gpu", "cpu"),
        default="auto",
        help="whose defaults to use (auto: gpu where nvidia-smi runs)",
    )
    p.add_argument("--tp", type=bm.positive_int, default=1, help="tensor-parallel degree")
    p.add_argument(
        "--dtype",
        choices=tuple(bm.DTYPES),
        help="parameter dtype (default: bfloat16 on GPUs, float32 on CPUs)",
    )
    p.add_argument(
        "--clients",
        type=bm.positive_int,
        help="concurrent streaming clients (default: 64 on GPUs, 4 on CPUs)",
    )
    p.add_argument(
        "--num-requests",
        type=bm.positive_int,
        help="requests per run (default: 256 on GPUs, 8 on CPUs)",
    )
    p.add_argument(
        "--prompt-len",
        type=bm.positive_int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="prompt lengths (default: 128 1024 on GPUs, 4 24 on CPUs)",
    )
    p.add_argument(
        "--output-len",
        type=bm.positive_int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="output lengths (default: 128 512 on GPUs, 2 8 on CPUs)",
    )
    p.add_argument(
        "--schedule",
        choices=("weave", "baseline"),
        default="weave",
        help="the engine's schedule (default: the engine's, weave)",
    )
    for name in ENGINE_OPTIONS:
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=bm.positive_int,
            help=bm.ENGINE_OPTIONS[name] + " (default: the engine's)",
        )
    p.add_argument("--url", help="a running server (its engine options are its own)")
    p.add_argument(
        "--server-log",
        type=Path,
        metavar="FILE",
        help="the started server's output (default: http_bench_server_<pid>.log in the "
        "temporary folder)",
    )
    p.add_argument("--no-inprocess", action="store_true", help="skip the in-process run")
    p.add_argument(
        "--startup-timeout",
        type=bm.positive_float,
        default=1800.0,
        help="seconds the server may take to load and compile",
    )
    p.add_argument("--seed", type=bm.nonnegative_int, default=0, help="workload/weights seed")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the platform's defaults filled in."""
    a = argparse.Namespace(**vars(args))
    if a.platform == "auto":
        a.platform = "gpu" if shutil.which("nvidia-smi") else "cpu"
    for name, value in DEFAULTS[a.platform].items():
        if getattr(a, name, None) is None and not (name in ("random", "layers") and a.model):
            setattr(a, name, value)
    if a.prompt_len[0] > a.prompt_len[1] or a.output_len[0] > a.output_len[1]:
        raise SystemExit("http_bench.py: error: MIN exceeds MAX")
    return a


def make_requests(a: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """The seeded ``(prompt ids, output length)`` of every request (ids from 3: no special)."""
    rng = np.random.default_rng(a.seed)
    lens = rng.integers(a.prompt_len[0], a.prompt_len[1] + 1, a.num_requests)
    outs = rng.integers(a.output_len[0], a.output_len[1] + 1, a.num_requests)
    return [
        (rng.integers(3, vocab, int(n)).tolist(), int(m)) for n, m in zip(lens, outs, strict=True)
    ]


def warmup_requests(a: argparse.Namespace, requests: list, vocab: int) -> list:
    """The untimed first ``clients`` requests: the lengths of the timed run's first ones, other
    token ids (so the timed run finds none of its prompts in the prefix cache)."""
    rng = np.random.default_rng([a.seed, 1])
    return [(rng.integers(3, vocab, len(p)).tolist(), n) for p, n in requests[: a.clients]]


def engine_sizes(a: argparse.Namespace) -> dict[str, int]:
    """The engine sizes both runs share: a cache for ``clients`` requests of the longest."""
    longest = a.prompt_len[1] + a.output_len[1]
    block = a.block_size or 16
    sizes = {
        "max_num_seqs": a.clients,
        "max_model_len": longest + 1,
        "num_blocks": a.clients * ceil_div(longest, block) + 1,
    }
    sizes.update({n: getattr(a, n) for n in ENGINE_OPTIONS if getattr(a, n) is not None})
    return sizes


def summary(records: list[dict[str, float]], seconds: float) -> dict[str, Any]:
    """Throughput and latency percentiles of finished requests."""
    made = sum(r["tokens"] for r in records)
    prompt = sum(r["prompt"] for r in records)
    ttft = [r["ttft"] for r in records]
    tpot = [r["tpot"] for r in records if r["tpot"] is not None]
    ms = lambda xs, q: float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else None
    return {
        "seconds": seconds,
        "requests": len(records),
        "output_tokens": made,
        "output_tok_s": made / seconds,
        "total_tok_s": (made + prompt) / seconds,
        "requests_s": len(records) / seconds,
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "tpot_p50_ms": ms(tpot, 50),
        "tpot_p99_ms": ms(tpot, 99),
    }


# ------------------------------------------------------------------------------- HTTP ---


def run_http(
    a: argparse.Namespace, requests: list, warm: list, sizes: dict[str, int]
) -> dict[str, Any]:
    """The HTTP run (a server started here unless ``--url``)."""
    client = bm.sibling_module(__file__, "http_client")
    if a.url:
        proc, url = None, a.url.rstrip("/")
    else:
        log = a.server_log or Path(tempfile.gettempdir()) / f"http_bench_server_{os.getpid()}.log"
        print(f"http_bench: the server's log: {log}", file=sys.stderr)
        proc, url = client.start_server(a, sizes, log)
    try:
        import httpx

        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(client.closed_loop(url, model, warm, a.clients))  # untimed
        records, seconds = asyncio.run(client.closed_loop(url, model, requests, a.clients))
        metrics = httpx.get(url + "/metrics", timeout=30).text
        leaked = [x for x in metrics.splitlines() if x.startswith("tokenweave_kv_blocks_in_use")]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    return {**summary(records, seconds), "url": url, "kv_blocks_in_use_after": leaked}


# -------------------------------------------------------------------------- in-process ---


def run_inprocess(
    a: argparse.Namespace, requests: list, warm: list, sizes: dict[str, int]
) -> dict[str, Any]:
    """The same closed loop through the engine of an in-process ``LLM``."""
    bm.use_cpu_devices(max(a.tp, 1))
    from jax_tokenweave.serving import LLM, SamplingParams

    kw = dict(max_logprobs=0, seed=a.seed, schedule=a.schedule, warmup=True, **sizes)
    if a.model:
        llm = LLM(a.model, tensor_parallel_size=a.tp, dtype=a.dtype, **kw)
    else:
        from flax import nnx

        from jax_tokenweave.models.llama import LlamaModel
        from jax_tokenweave.serving.offline.llm import make_mesh

        config = bm.load_config(a.random, a.layers)
        model = LlamaModel(
            config, make_mesh(None, a.tp), dtype=bm.DTYPES[a.dtype], rngs=nnx.Rngs(a.seed)
        )
        llm = LLM(model, tokenizer=False, **kw)
    engine = llm.engine

    def closed_loop(reqs: list) -> tuple[list[dict[str, Any]], float]:
        todo, live, records = list(reversed(reqs)), set(), []
        start = time.perf_counter()
        while todo or live:
            while todo and len(live) < a.clients:
                prompt, n = todo.pop()
                live.add(
                    engine.add_request(
                        prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                    )
                )
            for d in engine.step():
                if d.request_finished:
                    out = engine.release(d.request_id)
                    live.discard(d.request_id)
                    k = len(out.token_ids)
                    records.append(
                        {
                            "tokens": k,
                            "prompt": len(out.prompt_token_ids),
                            "ttft": out.metrics.ttft,
                            "tpot": out.metrics.tpot(k),
                        }
                    )
        return records, time.perf_counter() - start

    closed_loop(warm)  # untimed
    records, seconds = closed_loop(requests)
    return summary(records, seconds)


# ------------------------------------------------------------------------------ report ---


def to_markdown(report: dict[str, Any]) -> str:
    rows = [
        "| run | output tok/s | total tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
        "|---" * 6 + "|",
    ]
    fmt = bm.number_or_dash
    for name, r in report["runs"].items():
        rows.append(
            f"| {name} | {fmt(r['output_tok_s'])} | {fmt(r['total_tok_s'])} | "
            f"{fmt(r['requests_s'], 2)} | {fmt(r['ttft_p50_ms'])} / "
            f"{fmt(r['ttft_p99_ms'])} | {fmt(r['tpot_p50_ms'], 2)} / "
            f"{fmt(r['tpot_p99_ms'], 2)} |"
        )
    w = report["workload"]
    lines = [
        f"HTTP serving: {report['model']}, TP {w['tp']}, {w['clients']} concurrent "
        f"streaming clients, {w['num_requests']} requests (prompt {w['prompt_len']}, "
        f"output {w['output_len']} tokens)",
        "",
        *rows,
    ]
    if report.get("http_over_inprocess") is not None:
        lines += ["", f"Output throughput, HTTP / in-process: {report['http_over_inprocess']:.3f}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = resolve(build_parser().parse_args(argv))
    if a.model is None and a.random is None:
        raise SystemExit("http_bench.py: error: give --model or --random")
    a.out.mkdir(parents=True, exist_ok=True)
    vocab = _vocab(a)
    requests = make_requests(a, vocab)
    warm, sizes = warmup_requests(a, requests, vocab), engine_sizes(a)
    runs = {"http": run_http(a, requests, warm, sizes)}
    print(f"http: {runs['http']['output_tok_s']:.1f} output tok/s", file=sys.stderr)
    if not a.no_inprocess:
        runs["inprocess"] = run_inprocess(a, requests, warm, sizes)
        print(f"inprocess: {runs['inprocess']['output_tok_s']:.1f} output tok/s", file=sys.stderr)
    ratio = (
        runs["http"]["output_tok_s"] / runs["inprocess"]["output_tok_s"]
        if "inprocess" in runs
        else None
    )
    import jax

    report = {
        "model": a.model
        or f"{a.random} (random weights{f', {a.layers} layers' if a.layers else ''})",
        "workload": {
            "tp": a.tp,
            "clients": a.clients,
            "num_requests": a.num_requests,
            "prompt_len": a.prompt_len,
            "output_len": a.output_len,
            "dtype": a.dtype,
            "schedule": a.schedule,
            "seed": a.seed,
        },
        "engine": sizes,
        "runs": runs,
        "http_over_inprocess": ratio,
        "environment": bm.environment(jax.devices(), ["benchmarks/http_bench.py", *argv]),
    }
    (a.out / "http.json").write_text(json.dumps(report, indent=2) + "\n")
    (a.out / "http.md").write_text(to_markdown(report) + "\n")
    print(to_markdown(report))
    return 0


def _vocab(a: argparse.Namespace) -> int:
    """The model's vocabulary size, without starting JAX (config.json or the named config)."""
    if a.model:
        from jax_tokenweave.hf.config import load_hf_config
        from jax_tokenweave.serving.offline.resolve import checkpoint_dir

        return load_hf_config(checkpoint_dir(a.model)).config.vocab_size
    from jax_tokenweave.models.configs import get_config

    return get_config(a.random).vocab_size


if __name__ == "__main__":
    sys.exit(main())
