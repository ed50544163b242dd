"""What the serving command lines share (``python -m jax_tokenweave.generate`` and
``python -m jax_tokenweave.serve``): the devices ``--tp`` needs, the ``LLM`` options, and known
errors as one line instead of a traceback.

Importing this module sets nothing; :func:`start_devices` asks JAX for the virtual CPU devices
``--tp`` needs on a CPU-only host (as the main job does, ``benchmarking.use_cpu_devices``), so
call it before anything starts JAX's backends.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from jax_tokenweave import benchmarking as bm

DTYPE_CHOICES = ("auto", *bm.DTYPES)


def known_errors() -> tuple[type[BaseException], ...]:
    """The errors a command line reports in one line: bad checkpoints and configs, bad
    arguments (``ValueError``), missing files, a failed request."""
    from jax_tokenweave.serving.llm import RequestFailed

    return (ValueError, OSError, RequestFailed)


def fail(err: BaseException, prog: str) -> int:
    """Print ``err`` as one line (``prog: error: ...``) to stderr; the exit status 1."""
    message = " ".join(str(err).split()) or type(err).__name__
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 1


def start_devices(tp: int, cpu_devices: int | None) -> None:
    """Ask for ``cpu_devices`` (default ``tp``) virtual CPU devices where JAX has no others
    (``benchmarking.use_cpu_devices``); its note, if any, to stderr."""
    note = bm.use_cpu_devices(cpu_devices or tp)
    if note:
        print(f"note: {note}", file=sys.stderr)


def add_llm_options(p: argparse.ArgumentParser, engine_options: tuple[str, ...]) -> None:
    """``--tp``, ``--dtype``, ``--schedule``, ``--comm``, the engine sizes, ``--seed``,
    ``--gpu-memory-utilization`` and ``--cpu-devices``."""
    from jax_tokenweave.serving.config import SERVING_SCHEDULES, EngineConfig

    defaults = EngineConfig()
    p.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=bm.positive_int,
        default=1,
        help="tensor-parallel degree (on a CPU-only host, as many virtual devices)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="parameter dtype (auto: the checkpoint's torch_dtype)",
    )
    p.add_argument(
        "--schedule",
        choices=SERVING_SCHEDULES,
        default=defaults.schedule,
        help="weave (TokenWeave) or baseline (plain TP)",
    )
    p.add_argument(
        "--comm",
        choices=bm.COMMS,
        default=defaults.comm,
        help="weave's reductions: the fused kernel (ffi), XLA, or auto",
    )
    bm.add_engine_options(p, engine_options)
    p.set_defaults(max_model_len=None, num_blocks=None)
    for action in p._actions:
        if action.dest == "max_model_len":
            action.help = "positions per request (default: the checkpoint's)"
        elif action.dest == "num_blocks":
            action.help = "KV cache blocks (default: sized by --gpu-memory-utilization)"
    p.add_argument(
        "--gpu-memory-utilization",
        type=bm.positive_float,
        default=0.9,
        help="share of each device's memory for weights, activations and KV cache",
    )
    p.add_argument(
        "--engine-seed",
        type=bm.nonnegative_int,
        default=0,
        help="seeds the requests that bring none",
    )
    p.add_argument(
        "--cpu-devices",
        type=bm.positive_int,
        help="virtual CPU devices to ask for on CPU-only hosts (default: --tp)",
    )


def llm_kwargs(args: argparse.Namespace, engine_options: tuple[str, ...]) -> dict[str, Any]:
    """``LLM(...)`` keywords of :func:`add_llm_options`' options."""
    from jax_tokenweave.serving.resolve import TORCH_DTYPES

    kw: dict[str, Any] = {
        name: getattr(args, name) for name in engine_options if getattr(args, name) is not None
    }
    kw.update(
        tensor_parallel_size=args.tp,
        dtype=args.dtype if args.dtype == "auto" else TORCH_DTYPES[args.dtype],
        schedule=args.schedule,
        comm=args.comm,
        seed=args.engine_seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    return kw
