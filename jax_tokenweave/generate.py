"""Generate text from a Hugging Face checkpoint: ``python -m jax_tokenweave.generate``.

    python -m jax_tokenweave.generate /path/to/checkpoint --tp 2 --prompt "The capital of France is"

Serves the prompts with ``jax_tokenweave.LLM`` over ``--tp`` devices (virtual ones on a CPU
host). ``--ids`` takes token ids, ``--stream`` prints tokens as made; known errors print one
line. The options in full: docs/PACKAGE.md#generate.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from jax_tokenweave.serving import cli

PROG = "python -m jax_tokenweave.generate"
_ENGINE_OPTIONS = tuple(cli.ENGINE_OPTIONS)


def token_ids(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]`` (an ``argparse`` type: integers >= 0; an empty item, as in
    ``"1,,3"``, is an error, not skipped)."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or "" in parts:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids, got {text!r} (an empty item)"
        )
    return [cli.nonnegative_int(item) for part in parts for item in part.split()]


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; see ``--help``."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description=cli.plain(__doc__.split("\n\n")[0]),
        formatter_class=cli.HelpFormatter,
    )
    p.add_argument(
        "checkpoint",
        help="directory with config.json + *.safetensors (+ tokenizer), "
        "or a Hugging Face model id in the local cache",
    )
    p.add_argument("--prompt", action="append", help="a text prompt (repeat)")
    p.add_argument(
        "--ids",
        action="append",
        type=token_ids,
        help="a prompt of comma-separated token ids (repeat)",
    )
    p.add_argument(
        "--max-tokens", type=cli.positive_int, default=64, help="new tokens per prompt at most"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (vLLM's default: 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0 = all tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--stop", action="append", help="a stop string (repeat)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are made")
    cli.add_llm_options(p, _ENGINE_OPTIONS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.prompt, args.ids, args.stop = args.prompt or [], args.ids or [], args.stop or []
    if not args.prompt and not args.ids:
        parser.error("give at least one --prompt or --ids")
    cli.start_devices(args.tp, args.cpu_devices)

    from jax_tokenweave.serving import LLM, SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_tokens=args.max_tokens,
            stop=tuple(args.stop),
        )
    except ValueError as err:
        parser.error(str(err))
    try:
        return _run(args, LLM(args.checkpoint, **cli.llm_kwargs(args, _ENGINE_OPTIONS)), params)
    except cli.known_errors() as err:
        return cli.fail(err, PROG)


def _run(args: argparse.Namespace, llm: Any, params: Any) -> int:
    print(
        f"loaded {args.checkpoint} (TP {args.tp}, {llm.engine.runner.cache.k[0].dtype}, "
        f"{'text' if llm.tokenizer else 'token ids only: no tokenizer'})",
        file=sys.stderr,
    )
    prompts: list[str | list[int]] = [*args.prompt, *args.ids]
    start = time.perf_counter()
    made = 0
    if args.stream:
        for prompt in prompts:
            for delta in llm.stream(prompt, params):
                made += len(delta.token_ids)
                shown = (
                    delta.text
                    if delta.text is not None
                    else " " + " ".join(map(str, delta.token_ids))
                )
                print(shown, end="", flush=True)
            print()
    else:
        for out in llm.generate(prompts, params, use_tqdm=False):
            made += len(out.token_ids)
            head = (
                out.prompt if out.prompt is not None else ",".join(map(str, out.prompt_token_ids))
            )
            tail = out.text if out.text is not None else ",".join(map(str, out.token_ids))
            print(f"{head} -> {tail}  [{out.finish_reason}]")
    seconds = time.perf_counter() - start
    print(f"{made} tokens in {seconds:.2f}s (compilation included)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
