"""What the command lines share (``python -m jax_tokenweave.generate``, ``python -m
jax_tokenweave.serve``, the main job ``python -m jax_tokenweave.bench`` and ``benchmarks/``):
argument types, the help format, the engine options, the devices ``--tp`` needs, named configs,
and known errors as one line instead of a traceback.

Importing this module sets nothing; :func:`use_cpu_devices` (and :func:`start_devices`) ask JAX
for the virtual CPU devices a CPU-only host needs, so call them before anything starts JAX's
backends.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_tokenweave.weave.schedules import COLLECTIVES

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


_XLA_DEVICE_FLAG = "--xla_force_host_platform_device_count"


ENGINE_OPTIONS: dict[str, str] = {
    "max_num_batched_tokens": "token budget of a serving step (rows, padding included)",
    "max_num_seqs": "requests running at once",
    "max_model_len": "positions per request (prompt + new tokens)",
    "num_blocks": "KV cache blocks",
    "block_size": "positions per KV cache block",
    "prefill_tile": "rows per prompt-chunk attention tile (a power of two)",
    "key_chunk": "keys per step of the attention loop",
    "split_threshold": "steps of at least this many rows are woven (split in two halves)",
}
"""The ``serving.EngineConfig`` sizes the command lines take (``--max-num-seqs`` ...), with help."""
ENGINE_OPTION_ALIASES = {"num_blocks": ("--num-gpu-blocks-override",)}
"""vLLM's names of :data:`ENGINE_OPTIONS` where they differ, accepted too."""


def use_cpu_devices(count: int) -> str | None:
    """Ask JAX for ``count`` virtual CPU devices (``jax.config`` ``jax_num_cpu_devices``).

    Leaves a number the user chose (``JAX_NUM_CPU_DEVICES`` or the XLA flag) alone. Call it before
    JAX's backends start; where they already have, with another number of CPU devices, returns
    a message saying so (the run then uses the devices there are), else None.
    """
    # jax.config's options are attributes it sets at run time: its stubs do not declare them
    chosen: int = jax.config.jax_num_cpu_devices  # type: ignore[attr-defined]
    if chosen >= 0 or _XLA_DEVICE_FLAG in os.environ.get("XLA_FLAGS", ""):
        return None
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have != count:
            return (
                f"JAX's backends started before {count} virtual CPU devices could be asked "
                f"for; using the {have} CPU device(s) there are (run in a fresh process, or "
                f"set JAX_NUM_CPU_DEVICES={count})"
            )
    return None


def load_config(model: str, layers: int | None) -> Any:
    """The named ``DecoderConfig``, with ``num_layers`` replaced when ``layers`` is given."""
    from jax_tokenweave.models.configs import get_config

    config = get_config(model)
    if layers is not None:
        config = dataclasses.replace(config, num_layers=layers)
    return config


def config_names_help() -> str:
    """``"one of: tiny, tiny-moe, ..."`` for ``--model`` helps."""
    from jax_tokenweave.models.configs import config_names

    return "one of: " + ", ".join(config_names())


def _number(text: str, kind: type, minimum: float, strict: bool = False) -> Any:
    """``kind(text)``, which must be ``>= minimum`` (``> minimum`` if ``strict``) and finite."""
    try:
        value = kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if not (value > minimum if strict else value >= minimum) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be {'>' if strict else '>='} {minimum}")
    return value


def positive_ints(text: str) -> list[int]:
    """``"2048,8192"`` or ``"2048"`` -> ints >= 1 (an ``argparse`` type)."""
    values = [_number(part, int, 1) for part in text.replace(",", " ").split()]
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def positive_int(text: str) -> int:
    """One int >= 1 (an ``argparse`` type)."""
    values = positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one integer, got {text!r}")
    return values[0]


def nonnegative_int(text: str) -> int:
    """One int >= 0 (an ``argparse`` type)."""
    return _number(text, int, 0)


def positive_float(text: str) -> float:
    """One finite float > 0 (an ``argparse`` type; NaN is refused)."""
    return _number(text, float, 0, strict=True)


def add_collective_option(parser: argparse.ArgumentParser, default: str, help: str) -> None:
    """``--collective`` (weave's reductions, one of ``COLLECTIVES``)."""
    parser.add_argument("--collective", choices=COLLECTIVES, default=default, help=help)


def add_engine_options(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """``--<name>`` options for these ``ENGINE_OPTIONS``, defaulting to ``EngineConfig``'s
    (``--split-threshold``: the tuning table's)."""
    from jax_tokenweave.serving.config import EngineConfig

    defaults = EngineConfig()
    for name in names:
        default = getattr(defaults, name)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            *ENGINE_OPTION_ALIASES.get(name, ()),
            dest=name,
            type=positive_int,
            default=default,
            help=ENGINE_OPTIONS[name]
            + ("" if default is not None else " (default: the tuning table's)"),
        )


def engine_options(args: argparse.Namespace, names: Sequence[str]) -> dict[str, int]:
    """The values of :func:`add_engine_options`' options, by ``EngineConfig`` field."""
    return {name: getattr(args, name) for name in names}


def plain(text: str) -> str:
    """``text`` (a docstring's paragraph) as ``--help`` shows it: no reST markup (double
    backticks, ``:func:`` roles)."""
    return re.sub(r":\w+:`([^`]+)`", r"\1", text).replace("``", "")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help that shows each option's default as it is typed (``2 4``, not ``[2, 4]``), and no
    default for required options, flags, or options whose default is None (their help says)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.required
            or action.nargs == 0
            or default is None
            or default is argparse.SUPPRESS
            or "default" in text
        ):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})"


DTYPE_CHOICES = ("auto", *DTYPES)


def known_errors() -> tuple[type[BaseException], ...]:
    """The errors a command line reports in one line: bad checkpoints and configs, bad
    arguments (``ValueError``), missing files, a failed request."""
    from jax_tokenweave.serving.offline.llm import RequestFailed

    return (ValueError, OSError, RequestFailed)


def fail(err: BaseException, prog: str) -> int:
    """Print ``err`` as one line (``prog: error: ...``) to stderr; the exit status 1."""
    message = " ".join(str(err).split()) or type(err).__name__
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 1


def start_devices(tp: int, cpu_devices: int | None) -> None:
    """Ask for ``cpu_devices`` (default ``tp``) virtual CPU devices where JAX has no others
    (:func:`use_cpu_devices`); its note, if any, to stderr."""
    note = use_cpu_devices(cpu_devices or tp)
    if note:
        print(f"note: {note}", file=sys.stderr)


def add_llm_options(p: argparse.ArgumentParser, engine_options: tuple[str, ...]) -> None:
    """``--tp``, ``--dtype``, ``--schedule``, ``--collective``, the engine sizes, ``--seed``,
    ``--gpu-memory-utilization`` and ``--cpu-devices``."""
    from jax_tokenweave.serving.config import SERVING_SCHEDULES, EngineConfig

    defaults = EngineConfig()
    p.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=positive_int,
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
    add_collective_option(
        p, defaults.collective, "weave's reductions: the fused kernel (ffi), XLA, or auto"
    )
    add_engine_options(p, engine_options)
    p.set_defaults(max_model_len=None, num_blocks=None)
    for action in p._actions:
        if action.dest == "max_model_len":
            action.help = "positions per request (default: the checkpoint's)"
        elif action.dest == "num_blocks":
            action.help = "KV cache blocks (default: sized by --gpu-memory-utilization)"
    add_kv_cache_options(p)
    p.add_argument(
        "--gpu-memory-utilization",
        type=positive_float,
        default=0.9,
        help="share of each device's memory for weights, activations and KV cache",
    )
    p.add_argument(
        "--engine-seed",
        type=nonnegative_int,
        default=0,
        help="seeds the requests that bring none",
    )
    p.add_argument(
        "--cpu-devices",
        type=positive_int,
        help="virtual CPU devices to ask for on CPU-only hosts (default: --tp)",
    )


def add_kv_cache_options(p: argparse.ArgumentParser) -> None:
    """``--kv-allocation`` and ``--enable-prefix-caching`` / ``--no-enable-prefix-caching``
    (vLLM's flag), ``EngineConfig`` fields of the same names."""
    from jax_tokenweave.serving.config import KV_ALLOCATIONS, EngineConfig

    defaults = EngineConfig()
    p.add_argument(
        "--kv-allocation",
        choices=KV_ALLOCATIONS,
        default=defaults.kv_allocation,
        help="KV blocks as a request's tokens arrive, preempting where none is free "
        "(on_demand), or all of prompt + max_tokens at admission (reserve)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=defaults.enable_prefix_caching,
        help="reuse the cached KV blocks of a request's longest cached prefix (default: on)",
    )


def llm_kwargs(args: argparse.Namespace, engine_options: tuple[str, ...]) -> dict[str, Any]:
    """``LLM(...)`` keywords of :func:`add_llm_options`' options."""
    from jax_tokenweave.serving.offline.resolve import TORCH_DTYPES

    kw: dict[str, Any] = {
        name: getattr(args, name) for name in engine_options if getattr(args, name) is not None
    }
    kw.update(
        tensor_parallel_size=args.tp,
        dtype=args.dtype if args.dtype == "auto" else TORCH_DTYPES[args.dtype],
        schedule=args.schedule,
        collective=args.collective,
        seed=args.engine_seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_allocation=args.kv_allocation,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    return kw
