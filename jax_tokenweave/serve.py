"""``python -m jax_tokenweave.serve CHECKPOINT --tp N``: the OpenAI-compatible server.

Serves a Hugging Face checkpoint (directory or cached id) over ``--tp`` devices; ``--random
NAME`` a named config with random weights (token ids only). Compiles (or loads from the
executable cache) every step program before listening, saying how far it got on stderr
(``--no-warmup`` skips it); SIGTERM / Ctrl-C drain for ``--drain-timeout`` seconds.

The server itself: ``jax_tokenweave.openai_server``. Endpoints and shutdown:
docs/SERVING.md#serve.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from jax_tokenweave.openai_server import INSTALL_HINT  # noqa: F401  (the dependency check first)
from jax_tokenweave.openai_server.errors import DEFAULT_MAX_REQUEST_BYTES
from jax_tokenweave.serving import cli

PROG = "python -m jax_tokenweave.serve"
ENGINE_OPTIONS = tuple(cli.ENGINE_OPTIONS)


def tcp_port(text: str) -> int:
    """A TCP port, 0 to 65535 (an ``argparse`` type; 0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port, 0 to 65535, got {text!r}")
    return port


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; see ``--help``."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description=cli.plain(__doc__.split("\n\n")[0]),
        epilog=cli.plain(__doc__.split("\n\n")[1]),
        formatter_class=cli.HelpFormatter,
    )
    p.add_argument(
        "model", nargs="?", help="checkpoint directory or Hugging Face model id in the local cache"
    )
    p.add_argument(
        "--random",
        metavar="NAME",
        help=f"serve this named config with random weights instead ({cli.config_names_help()})",
    )
    p.add_argument(
        "--layers",
        type=cli.positive_int,
        help="--random: decoder layers to stack (default: the config's)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=tcp_port, default=8000, help="port to listen on (0: any free)")
    p.add_argument(
        "--served-model-name",
        help="the model's name in the API (default: MODEL, or the --random name)",
    )
    p.add_argument(
        "--max-waiting",
        type=cli.positive_int,
        default=1024,
        help="requests waiting for admission at most; beyond: 429",
    )
    p.add_argument(
        "--max-request-bytes",
        type=cli.positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body taken; beyond: 413",
    )
    p.add_argument(
        "--drain-timeout",
        type=cli.positive_float,
        default=30.0,
        help="seconds requests in flight may take to finish after SIGTERM",
    )
    p.add_argument(
        "--max-logprobs",
        type=cli.nonnegative_int,
        default=20,
        help="top log-probabilities a request may ask for",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="do not compile every step program before listening",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level",
    )
    cli.add_llm_options(p, ENGINE_OPTIONS)
    return p


def load(args: argparse.Namespace) -> Any:
    """The ``LLM`` the options describe."""
    from jax_tokenweave.serving import LLM

    kw = cli.llm_kwargs(args, ENGINE_OPTIONS)
    kw.update(max_logprobs=args.max_logprobs, warmup=False)  # warm_up() reports it
    if args.random is None:
        return LLM(args.model, **kw)
    import jax.numpy as jnp
    from flax import nnx

    from jax_tokenweave.models.llama import LlamaModel
    from jax_tokenweave.serving.offline.llm import make_mesh

    config = cli.load_config(args.random, args.layers)
    dtype = jnp.bfloat16 if kw["dtype"] == "auto" else kw["dtype"]
    model = LlamaModel(
        config, make_mesh(None, args.tp), dtype=dtype, rngs=nnx.Rngs(args.engine_seed)
    )
    for key in ("tensor_parallel_size", "dtype"):
        kw.pop(key)
    return LLM(model, tokenizer=False, **kw)


def warm_up(llm: Any, out: TextIO = sys.stderr) -> None:
    """Make every step program (``LLMEngine.warmup``): a line saying how many, a progress bar
    and a line with how many were loaded from the executable cache and compiled, in seconds,
    to ``out``."""
    count = len(llm.engine.layouts())
    cache = llm.engine.config.compilation_cache_dir
    where = f"executable cache: {cache}" if cache else "no executable cache"
    print(
        f"jax-tokenweave: warm-up: {count} step programs to load or compile ({where})",
        file=out,
        flush=True,
    )
    report = llm.engine.warmup(progress=True)
    print(
        f"jax-tokenweave: warm-up done: {report.layouts} step programs "
        f"({report.loaded} loaded, {report.compiled} compiled) in {report.seconds:.1f} s",
        file=out,
        flush=True,
    )


def describe(llm: Any, name: str, host: str, port: int) -> str:
    """The startup line."""
    cfg = llm.engine.config
    return (
        f"jax-tokenweave: serving {name!r} (TP {llm.engine.tp}, "
        f"{llm.engine.cache.k[0].dtype}, max_model_len {cfg.max_model_len}, "
        f"{cfg.num_blocks} KV blocks of {cfg.block_size}, max_num_seqs {cfg.max_num_seqs}, "
        f"{'text' if llm.tokenizer else 'token ids only'}) on http://{host}:{port}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.model is None) == (args.random is None):
        parser.error("give a MODEL (checkpoint) or --random NAME, not both")
    if args.served_model_name is not None and not args.served_model_name.strip():
        parser.error("--served-model-name: an empty name (leave it out to serve as MODEL)")
    cli.start_devices(args.tp, args.cpu_devices)
    try:
        llm = load(args)
    except cli.known_errors() as err:
        return cli.fail(err, PROG)
    if not args.no_warmup:
        warm_up(llm)
    name = args.served_model_name or args.model or args.random
    from jax_tokenweave.openai_server.server import run

    status = run(
        llm,
        name,
        args.host,
        args.port,
        max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes,
        drain_timeout=args.drain_timeout,
        log_level=args.log_level,
        startup_line=lambda port: describe(llm, name, args.host, port),
    )
    # The server has stopped; the interpreter's teardown (XLA's and torch's destructors) would
    # take seconds more, past the drain timeout: end the process now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
