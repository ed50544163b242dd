"""``serve_bench.py``'s synthetic requests, seeded: random token ids, each request a dict of
``prompt`` (ids), ``max_tokens`` (what the request asks for), ``output_len`` (where the client
ends it: at ``max_tokens``, or earlier as a stop string would) and ``arrival_s``.

- ``all-at-once`` / ``poisson``: prompt and output lengths uniform in ``--prompt-len`` /
  ``--output-len``, each request asking for exactly its output length; arrivals at 0, or at
  ``--rate`` requests per second (exponential gaps).
- ``chat``: prompt and output lengths log-normal (medians ``--chat-prompt-median`` /
  ``--chat-output-median``, ``--chat-sigma``, capped at ``--chat-prompt-max`` /
  ``--chat-output-max``), every request sent with ``max_tokens=--chat-max-tokens`` and ended by
  the client at its drawn length (the engine is not told it); all at once.
- ``shared-prefix``: one ``--system-len``-token system prompt, then a question of
  ``--question-len`` tokens (uniform), outputs of ``--output-len``; all at once.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

WORKLOADS = ("all-at-once", "poisson", "chat", "shared-prefix")


def add_options(p: argparse.ArgumentParser, positive_int: Any, positive_float: Any) -> None:
    """The workloads' length and arrival options."""
    p.add_argument(
        "--prompt-len",
        type=positive_int,
        nargs=2,
        default=[128, 4096],
        metavar=("MIN", "MAX"),
        help="all-at-once, poisson: prompt lengths, uniform in [MIN, MAX]",
    )
    p.add_argument(
        "--output-len",
        type=positive_int,
        nargs=2,
        default=[64, 512],
        metavar=("MIN", "MAX"),
        help="all-at-once, poisson, shared-prefix: output lengths, uniform in [MIN, MAX]",
    )
    p.add_argument(
        "--rate", type=positive_float, default=4.0, help="poisson workload: requests per second"
    )
    for name, default, what in (
        ("prompt-median", 512, "median prompt length"),
        ("output-median", 256, "median output length (where the client ends it)"),
        ("prompt-max", 4096, "longest prompt (longer draws are capped)"),
        ("output-max", 2048, "longest output (longer draws are capped)"),
        ("max-tokens", 2048, "max_tokens every request asks for"),
    ):
        p.add_argument(f"--chat-{name}", type=positive_int, default=default, help=f"chat: {what}")
    p.add_argument(
        "--chat-sigma",
        type=positive_float,
        default=1.0,
        help="chat: sigma of the lengths' log-normal distributions (of their logarithm)",
    )
    p.add_argument(
        "--system-len", type=positive_int, default=2048, help="shared-prefix: system prompt tokens"
    )
    p.add_argument(
        "--question-len",
        type=positive_int,
        nargs=2,
        default=[64, 256],
        metavar=("MIN", "MAX"),
        help="shared-prefix: question lengths after the system prompt, uniform in [MIN, MAX]",
    )


def check(args: argparse.Namespace) -> str | None:
    """What is wrong with the options (an error message), or None."""
    for name in ("prompt_len", "output_len", "question_len"):
        lo, hi = getattr(args, name)
        if lo > hi:
            return f"--{name.replace('_', '-')}: MIN ({lo}) exceeds MAX ({hi})"
    if args.chat_output_max > args.chat_max_tokens:
        return (
            f"--chat-output-max ({args.chat_output_max}) exceeds --chat-max-tokens "
            f"({args.chat_max_tokens}): a request would end before the client ends it"
        )
    return None


def make_requests(workload: str, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """``args.num_requests`` requests of ``workload`` (module docstring), seeded."""
    rng = np.random.default_rng([args.seed, WORKLOADS.index(workload)])
    n = args.num_requests

    def ids(length: int) -> list[int]:
        return rng.integers(0, vocab, int(length)).tolist()

    def lognormal(median: int, cap: int) -> np.ndarray:
        draws = rng.lognormal(np.log(median), args.chat_sigma, n)
        return np.clip(np.round(draws), 1, cap).astype(int)

    if workload in ("all-at-once", "poisson"):
        prompt_lens = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, n)
        output_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, n)
        gaps = rng.exponential(1.0 / args.rate, n) if workload == "poisson" else np.zeros(n)
        prompts = [ids(p) for p in prompt_lens]
        max_tokens = output_lens
    elif workload == "chat":
        prompt_lens = lognormal(args.chat_prompt_median, args.chat_prompt_max)
        output_lens = lognormal(args.chat_output_median, args.chat_output_max)
        prompts = [ids(p) for p in prompt_lens]
        max_tokens, gaps = np.full(n, args.chat_max_tokens), np.zeros(n)
    elif workload == "shared-prefix":
        system = ids(args.system_len)
        questions = rng.integers(args.question_len[0], args.question_len[1] + 1, n)
        output_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, n)
        prompts = [system + ids(q) for q in questions]
        max_tokens, gaps = output_lens, np.zeros(n)
    else:
        raise ValueError(f"unknown workload {workload!r}; one of {WORKLOADS}")
    arrivals = np.cumsum(gaps)
    return [
        {"prompt": p, "max_tokens": int(m), "output_len": int(o), "arrival_s": float(a)}
        for p, m, o, a in zip(prompts, max_tokens, output_lens, arrivals, strict=True)
    ]
