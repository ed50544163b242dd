"""Generate text from a Hugging Face checkpoint directory (Llama, Mistral, Qwen2, Mixtral).

    python -m jax_tokenweave.generate /path/to/checkpoint --tp 2 --prompt "The capital of France is"

Loads the checkpoint tensor-parallel over ``--tp`` devices and serves the prompts with
``jax_tokenweave.LLM`` (continuous batching, chunked prefill, paged KV cache; steps of at least
``--split-threshold`` tokens are woven). Text needs the tokenizer files in the directory;
``--ids 1,2,3`` passes token ids instead. ``--stream`` prints tokens as they are made. On a
CPU-only host, ``--cpu-devices N`` asks for N virtual devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence

from jax_tokenweave import benchmarking as bm
from jax_tokenweave.serving.config import SERVING_SCHEDULES, EngineConfig

PROG = "python -m jax_tokenweave.generate"
_ENGINE_OPTIONS = tuple(bm.ENGINE_OPTIONS)


def token_ids(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]`` (an ``argparse`` type: integers >= 0)."""
    values = [bm.nonnegative_int(part) for part in text.replace(",", " ").split()]
    if not values:
        raise argparse.ArgumentTypeError("expected comma-separated token ids")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; see ``--help``."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=bm.HelpFormatter)
    p.add_argument("checkpoint", help="directory with config.json + *.safetensors (+ tokenizer)")
    p.add_argument("--prompt", action="append", help="a text prompt (repeat)")
    p.add_argument("--ids", action="append", type=token_ids,
                   help="a prompt of comma-separated token ids (repeat)")
    p.add_argument("--tp", type=bm.positive_int, default=1, help="tensor-parallel degree")
    p.add_argument("--dtype", choices=tuple(bm.DTYPES), default="bfloat16",
                   help="parameter dtype")
    p.add_argument("--max-tokens", type=bm.positive_int, default=64,
                   help="new tokens per prompt at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0 = all tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--stop", action="append", help="a stop string (repeat)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are made")
    defaults = EngineConfig()
    p.add_argument("--schedule", choices=SERVING_SCHEDULES, default=defaults.schedule,
                   help="weave (TokenWeave) or baseline (plain TP)")
    p.add_argument("--comm", choices=bm.COMMS, default=defaults.comm,
                   help="weave's reductions: the fused kernel (ffi), XLA, or auto")
    bm.add_engine_options(p, _ENGINE_OPTIONS)
    p.add_argument("--cpu-devices", type=bm.positive_int,
                   help="virtual CPU devices to ask for (CPU-only hosts)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.prompt, args.ids, args.stop = args.prompt or [], args.ids or [], args.stop or []
    if not args.prompt and not args.ids:
        parser.error("give at least one --prompt or --ids")
    if args.cpu_devices:
        note = bm.use_cpu_devices(args.cpu_devices)
        if note:
            print(f"note: {note}", file=sys.stderr)

    from jax_tokenweave.serving import LLM, SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens,
                                stop=tuple(args.stop))
        config = dataclasses.replace(EngineConfig(), schedule=args.schedule, comm=args.comm,
                                     **bm.engine_options(args, _ENGINE_OPTIONS))
    except ValueError as err:
        parser.error(str(err))
    start = time.perf_counter()
    llm = LLM(args.checkpoint, tp=args.tp, dtype=bm.DTYPES[args.dtype], config=config)
    print(f"loaded {args.checkpoint} in {time.perf_counter() - start:.1f}s (TP {args.tp}, "
          f"{args.dtype}, {'text' if llm.tokenizer else 'token ids only: no tokenizer'})",
          file=sys.stderr)
    prompts: list[str | list[int]] = [*args.prompt, *args.ids]
    start = time.perf_counter()
    made = 0
    if args.stream:
        for prompt in prompts:
            for delta in llm.stream(prompt, params):
                made += len(delta.token_ids)
                shown = delta.text if delta.text is not None else \
                    " " + " ".join(map(str, delta.token_ids))
                print(shown, end="", flush=True)
            print()
    else:
        for out in llm.generate(prompts, params):
            made += len(out.token_ids)
            head = out.prompt if out.prompt is not None else ",".join(map(str,
                                                                         out.prompt_token_ids))
            tail = out.text if out.text is not None else ",".join(map(str, out.token_ids))
            print(f"{head} -> {tail}  [{out.finish_reason}]")
    seconds = time.perf_counter() - start
    print(f"{made} tokens in {seconds:.2f}s (compilation included)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
