"""The main job: time the decoder stack's schedules side by side.

``python -m jax_tokenweave.bench`` builds a tensor-parallel ``WeaveDecoder`` with random weights,
checks that the ``weave`` schedule computes what ``baseline`` does, then times ``baseline``
(XLA ``psum``), ``weave`` (TokenWeave: split + fused RS-norm-AG) and ``nocomm`` (no collectives:
the floor) the same way in one run and prints their median latencies and ratios.

On GPUs it defaults to Llama-3-70B shapes, 4 layers, TP = number of GPUs, 2048 and 8192 tokens
in requests of 1024; with no GPU it runs the ``tiny`` config on 8 virtual CPU devices (the XLA
flag for them is set here, before JAX is imported, only where no NVIDIA GPU is visible).
``--help`` lists the options; ``--json``/``--plot`` save the results.
"""

from __future__ import annotations

import glob
import importlib.util
import os


def _cuda_visible() -> bool:
    """Cheap, subprocess-free guess whether JAX will see a CUDA GPU (device nodes + plugin)."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() in ("cpu",):
        return False
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False
    for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12", "jax_cuda13_plugin",
                 "jax_cuda12_plugin"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


CPU_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"
if not _cuda_visible() and _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}={CPU_DEVICES}".strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform as _platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from jax_tokenweave import timing  # noqa: E402

SCHEDULES = ("baseline", "weave", "nocomm")
COMMS = ("auto", "xla", "ffi")
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
# Relative (Frobenius) error allowed between weave and baseline outputs, by dtype.
TOLERANCE = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 1e-4}


@dataclasses.dataclass(frozen=True)
class Defaults:
    """Per-platform defaults of the main job."""

    model: str
    layers: int
    tokens: tuple[int, ...]
    request_len: int
    warmup: int
    iters: int


GPU_DEFAULTS = Defaults("llama3-70b", 4, (2048, 8192), 1024, warmup=3, iters=20)
CPU_DEFAULTS = Defaults("tiny", 2, (1024, 2048, 4096), 256, warmup=3, iters=20)


# ----------------------------------------------------------------------------------- set-up ---

def platform_devices() -> tuple[str, list[jax.Device]]:
    """``("gpu", GPUs)`` where JAX has CUDA devices, else ``("cpu", CPU devices)``."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if gpus:
        return "gpu", gpus
    return "cpu", jax.devices("cpu")


def make_mesh(devices: Sequence[jax.Device], tp: int, axis_name: str = "tp") -> Mesh:
    """A 1-D mesh over the first ``tp`` devices (axis type Auto, see docs/ARCHITECTURE.md)."""
    if not 1 <= tp <= len(devices):
        raise ValueError(f"tp={tp} needs 1..{len(devices)} devices; this machine has "
                         f"{len(devices)}")
    return Mesh(np.array(list(devices)[:tp]), (axis_name,))


def load_config(model: str, layers: int | None) -> Any:
    """The named ``DecoderConfig``, with ``num_layers`` replaced when ``layers`` is given."""
    from jax_tokenweave.models.configs import get_config

    config = get_config(model)
    if layers is not None:
        config = dataclasses.replace(config, num_layers=layers)
    return config


def request_lengths(tokens: int, request_len: int) -> tuple[int, ...]:
    """``tokens`` packed as requests of ``request_len`` (the last one shorter if need be)."""
    if tokens < 1 or request_len < 1:
        raise ValueError(f"need tokens >= 1 and request_len >= 1, got {tokens}, {request_len}")
    full, rest = divmod(tokens, request_len)
    return (request_len,) * full + ((rest,) if rest else ())


def make_plan(config: Any, model: str, lengths: Sequence[int], tp: int, *,
              threshold: int | None = None, split: bool | None = None) -> Any:
    """``split.plan_batch`` with the wave model of ``config``'s gate/up GEMM at TP ``tp``."""
    from jax_tokenweave import split as split_mod

    kwargs: dict[str, Any] = {"tp": tp, "split": split, "model": model,
                              "wave": split_mod.WaveModel.from_config(config, tp)}
    if threshold is not None:
        kwargs["threshold"] = threshold
    return split_mod.plan_batch(tuple(lengths), **kwargs)


def build_decoder(config: Any, mesh: Mesh, dtype: Any, seed: int) -> Any:
    """A ``WeaveDecoder`` with fresh random weights (``nnx.Rngs(seed)``)."""
    from flax import nnx

    from jax_tokenweave.layers import WeaveDecoder

    return WeaveDecoder(config, mesh, dtype=dtype, rngs=nnx.Rngs(seed))


def random_hidden(num_tokens: int, hidden: int, dtype: Any, mesh: Mesh, seed: int) -> jax.Array:
    """Random normal hidden states ``[T, H]``, replicated over ``mesh``."""
    x = jax.random.normal(jax.random.key(seed), (num_tokens, hidden), jnp.float32).astype(dtype)
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))


def resolve_seed() -> int:
    """A fresh random seed from the OS (recorded in the results so a run can be replayed)."""
    return int(np.random.SeedSequence().entropy % (2**31))


def ffi_unavailable(mesh: Mesh, dtype: Any, shape: tuple[int, int],
                    axis_name: str = "tp") -> str | None:
    """Why ``comm="ffi"`` cannot run for this mesh, dtype and ``[T, H]`` (None where it can)."""
    from jax_tokenweave import _ffi

    return _ffi.unavailable_reason(mesh, axis_name, jnp.dtype(dtype), tuple(shape))


def compile_forward(decoder: Any, plan: Any, hidden: jax.Array, *, schedule: str,
                    comm: str = "auto") -> tuple[Callable[[], jax.Array], float]:
    """Compile ``decoder(hidden, plan, schedule=, comm=)``; returns ``(run, compile seconds)``.

    ``run()`` calls the compiled executable on ``hidden`` (asynchronously, like any JAX call).
    """
    import time

    from flax import nnx

    graphdef, state = nnx.split(decoder)

    def forward(state: Any, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(x, plan, schedule=schedule, comm=comm)

    start = time.perf_counter()
    compiled = jax.jit(forward).lower(state, hidden).compile()
    seconds = time.perf_counter() - start
    return (lambda: compiled(state, hidden)), seconds


# ------------------------------------------------------------------------------ environment ---

def git_commit() -> str | None:
    """``HEAD`` of the source checkout (``+dirty`` if modified), or None outside one.

    ``JAX_TOKENWEAVE_COMMIT`` wins where set: copies without ``.git`` (a GPU machine's) name the
    commit they were made from that way.
    """
    if os.environ.get("JAX_TOKENWEAVE_COMMIT"):
        return os.environ["JAX_TOKENWEAVE_COMMIT"]
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if not (root / ".git").exists():
            continue
        try:
            head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                                  capture_output=True, text=True, timeout=10).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "-uno"],
                                   check=True, capture_output=True, text=True,
                                   timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        return head + ("+dirty" if dirty else "")
    return None


def environment(devices: Sequence[jax.Device], argv: Sequence[str]) -> dict[str, Any]:
    """What the results were measured on: devices, versions, date, commit, command line."""
    import flax

    import jax_tokenweave

    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "num_devices": len(devices),
        "jax_version": jax.__version__,
        "flax_version": flax.__version__,
        "jax_tokenweave_version": jax_tokenweave.__version__,
        "python": _platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join([Path(sys.executable).name, "-m", "jax_tokenweave.bench", *argv]),
        "env": {k: os.environ[k] for k in sorted(os.environ)
                if k.startswith(("XLA_", "JAX_TOKENWEAVE_", "NCCL_"))},
    }


# ------------------------------------------------------------------------------- arguments ---

def _positive_ints(text: str) -> list[int]:
    values = []
    for part in text.replace(",", " ").split():
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not an integer") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value} must be >= 1")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _positive_int(text: str) -> int:
    values = _positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one integer, got {text!r}")
    return values[0]


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _schedules(text: str) -> list[str]:
    names = [s for s in text.replace(",", " ").split() if s]
    bad = [s for s in names if s not in SCHEDULES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown schedule(s) {bad or [text]}; choose from {', '.join(SCHEDULES)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The main job's command-line parser (defaults of None are filled in per platform)."""
    p = argparse.ArgumentParser(
        prog="python -m jax_tokenweave.bench",
        description="Time TokenWeave's schedules (baseline / weave / nocomm) side by side. "
                    f"Defaults on GPUs: {GPU_DEFAULTS.model}, {GPU_DEFAULTS.layers} layers, "
                    f"TP = number of GPUs, tokens {list(GPU_DEFAULTS.tokens)}; with no GPU: "
                    f"{CPU_DEFAULTS.model} on {CPU_DEVICES} virtual CPU devices.")
    p.add_argument("--model", help="model config name (jax_tokenweave.models.configs)")
    p.add_argument("--layers", type=_positive_int, help="decoder layers to stack")
    p.add_argument("--tp", type=_positive_int, help="tensor-parallel degree (default: all devices)")
    p.add_argument("--tokens", type=_positive_ints, nargs="+",
                   help="batch sizes in tokens, e.g. --tokens 2048 8192 (or 2048,8192)")
    p.add_argument("--request-len", type=_positive_int,
                   help="tokens per request packed into the batch")
    p.add_argument("--comm", choices=COMMS, default="auto",
                   help="communication of the weave schedule (default: auto)")
    p.add_argument("--schedules", type=_schedules, nargs="+",
                   help=f"schedules to time (default: all of {', '.join(SCHEDULES)})")
    p.add_argument("--split-threshold", type=_positive_int,
                   help="split batches of at least this many tokens (default: split.py's)")
    p.add_argument("--warmup", type=_nonnegative_int, help="untimed calls per schedule")
    p.add_argument("--iters", type=_positive_int, help="timed calls per schedule")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    p.add_argument("--tol", type=float,
                   help="max relative error of weave vs baseline (default: by dtype)")
    p.add_argument("--seed", type=_nonnegative_int, help="random seed (default: fresh)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", type=Path, metavar="PATH", help="write a bar chart (PNG)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def resolve_args(args: argparse.Namespace, platform: str, num_devices: int,
                 parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Fill in platform defaults and check the combination; ``parser.error`` on bad input."""
    d = GPU_DEFAULTS if platform == "gpu" else CPU_DEFAULTS
    args.model = args.model or d.model
    args.layers = args.layers or d.layers
    args.tp = args.tp or num_devices
    args.tokens = sorted({t for group in args.tokens for t in group}) if args.tokens \
        else list(d.tokens)
    args.request_len = args.request_len or d.request_len
    args.warmup = d.warmup if args.warmup is None else args.warmup
    args.iters = args.iters or d.iters
    args.schedules = list(dict.fromkeys(s for g in args.schedules for s in g)) \
        if args.schedules else list(SCHEDULES)
    args.tol = TOLERANCE[args.dtype] if args.tol is None else args.tol
    if args.tol <= 0:
        parser.error(f"--tol must be > 0, got {args.tol}")
    if args.tp > num_devices:
        parser.error(f"--tp {args.tp} needs {args.tp} devices; this machine has {num_devices} "
                     f"{platform.upper()} device(s)")
    try:
        config = load_config(args.model, args.layers)
    except (KeyError, ValueError) as err:
        parser.error(f"--model {args.model!r}: {err}")
    try:
        config.check_tensor_parallel(args.tp)
    except ValueError as err:
        parser.error(f"--tp {args.tp} does not fit --model {args.model}: {err}")
    args.config = config
    if args.seed is None:
        args.seed = resolve_seed()
    return args


# ------------------------------------------------------------------------------------- run ---

def run(args: argparse.Namespace, devices: Sequence[jax.Device],
        parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Verify and time every schedule for every token count; returns the results dict."""
    from tqdm import tqdm

    config, dtype = args.config, DTYPES[args.dtype]
    mesh = make_mesh(devices, args.tp)
    comm_used = {}
    for tokens in args.tokens:
        reason = ffi_unavailable(mesh, dtype, (tokens, config.hidden_size))
        if args.comm == "ffi" and "weave" in args.schedules and reason is not None:
            parser.error(f"--comm ffi is unavailable for {tokens} tokens here: {reason}")
        comm_used[tokens] = ("ffi" if reason is None else f"xla_rsag ({reason})") \
            if args.comm == "auto" else args.comm
    decoder = build_decoder(config, mesh, dtype, args.seed)
    verify = "weave" in args.schedules
    steps = len(args.tokens) * len(args.schedules) * (args.warmup + args.iters)
    bar = tqdm(total=steps, desc="bench", unit="call", disable=args.no_progress,
               dynamic_ncols=True, file=sys.stderr)
    results = []
    try:
        for i, tokens in enumerate(args.tokens):
            lengths = request_lengths(tokens, args.request_len)
            plan = make_plan(config, args.model, lengths, args.tp,
                             threshold=args.split_threshold)
            hidden = random_hidden(tokens, config.hidden_size, dtype, mesh, args.seed + 1 + i)
            fns, compile_s = {}, {}
            names = list(args.schedules)
            if verify and "baseline" not in names:
                names.append("baseline")
            for name in names:
                bar.set_description(f"T={tokens} compile {name}")
                comm = args.comm if name == "weave" else "auto"
                fns[name], compile_s[name] = compile_forward(decoder, plan, hidden,
                                                             schedule=name, comm=comm)
            rel_err = None
            if verify:
                bar.set_description(f"T={tokens} verify")
                rel_err = timing.rel_error(fns["weave"](), fns["baseline"]())
                if not rel_err <= args.tol:
                    bar.close()
                    raise VerificationError(tokens, rel_err, args.tol, args.dtype)
            bar.set_description(f"T={tokens} time")
            stats = timing.benchmark({n: fns[n] for n in args.schedules}, warmup=args.warmup,
                                     iters=args.iters, on_step=lambda: bar.update(1))
            results.append(_result(tokens, lengths, plan, rel_err, comm_used[tokens], stats,
                                   compile_s))
            del fns
    finally:
        bar.close()
    return {"environment": environment(devices, args.argv), "config": _config_dict(args),
            "results": results}


class VerificationError(RuntimeError):
    """weave's output differs from baseline's by more than the tolerance."""

    def __init__(self, tokens: int, rel_err: float, tol: float, dtype: str) -> None:
        super().__init__(
            f"weave and baseline disagree at {tokens} tokens: relative error {rel_err:.3g} > "
            f"tolerance {tol:.3g} ({dtype}); refusing to report timings")
        self.tokens, self.rel_err, self.tol = tokens, rel_err, tol


def _result(tokens: int, lengths: Sequence[int], plan: Any, rel_err: float | None, comm: str,
            stats: dict[str, timing.Stats], compile_s: dict[str, float]) -> dict[str, Any]:
    med = {name: s.median_ms for name, s in stats.items()}
    ratios = {}
    for a, b in (("baseline", "weave"), ("baseline", "nocomm"), ("weave", "nocomm")):
        if a in med and b in med:
            ratios[f"{a}_over_{b}"] = med[a] / med[b]
    return {
        "tokens": tokens, "num_requests": len(lengths), "request_lengths": list(lengths),
        "split": bool(plan.split), "half_lengths": [h.length for h in plan.halves],
        "split_offset": plan.offset, "weave_comm": comm, "rel_err_weave_vs_baseline": rel_err,
        "compile_s": compile_s, "schedules": {n: s.summary() for n, s in stats.items()},
        "ratios": ratios,
    }


def _config_dict(args: argparse.Namespace) -> dict[str, Any]:
    c = args.config
    return {
        "model": args.model, "layers": args.layers, "tp": args.tp, "dtype": args.dtype,
        "tokens": args.tokens, "request_len": args.request_len, "comm": args.comm,
        "schedules": args.schedules, "warmup": args.warmup, "iters": args.iters,
        "split_threshold": args.split_threshold, "tolerance": args.tol, "seed": args.seed,
        "shapes": {"hidden": c.hidden_size, "intermediate": c.intermediate_size,
                   "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
                   "experts": c.num_experts},
    }


# ---------------------------------------------------------------------------------- output ---

def format_table(report: dict[str, Any]) -> str:
    """The results as a fixed-width text table (medians in ms and ratios)."""
    schedules = report["config"]["schedules"]
    cols = ["tokens", "split", *[f"{s} ms" for s in schedules]]
    ratio_cols = [k for k in ("baseline_over_weave", "baseline_over_nocomm", "weave_over_nocomm")
                  if any(k in r["ratios"] for r in report["results"])]
    labels = {"baseline_over_weave": "speedup weave", "baseline_over_nocomm": "speedup nocomm",
              "weave_over_nocomm": "weave/nocomm"}
    cols += [labels[k] for k in ratio_cols] + ["rel err"]
    rows = []
    for r in report["results"]:
        split = "x".join(str(n) for n in r["half_lengths"]) if r["split"] else "no"
        row = [str(r["tokens"]), split]
        row += [f"{r['schedules'][s]['median_ms']:.3f}" for s in schedules]
        row += [f"{r['ratios'][k]:.3f}" if k in r["ratios"] else "-" for k in ratio_cols]
        err = r["rel_err_weave_vs_baseline"]
        row.append("-" if err is None else f"{err:.2e}")
        rows.append(row)
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
    out = [line(cols), line(["-" * w for w in widths]), *(line(r) for r in rows)]
    return "\n".join(out)


def describe(report: dict[str, Any]) -> str:
    """A header line saying what was measured, and on what."""
    c, e = report["config"], report["environment"]
    return (f"{c['model']}, {c['layers']} layers, TP={c['tp']}, {c['dtype']}, requests of "
            f"{c['request_len']} tokens, weave comm={c['comm']}; {e['num_devices']} x "
            f"{e['device_kind']} ({e['platform']}), jax {e['jax_version']}; median of "
            f"{c['iters']} runs after {c['warmup']} warm-up")


def write_plot(report: dict[str, Any], path: Path) -> None:
    """A grouped bar chart of the median latency per token count and schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedules = report["config"]["schedules"]
    results = report["results"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(schedules)
    x = np.arange(len(results))
    for i, name in enumerate(schedules):
        meds = [r["schedules"][name]["median_ms"] for r in results]
        lo = [m - r["schedules"][name]["p10_ms"] for m, r in zip(meds, results, strict=True)]
        hi = [r["schedules"][name]["p90_ms"] - m for m, r in zip(meds, results, strict=True)]
        ax.bar(x + (i - (len(schedules) - 1) / 2) * width, meds, width, yerr=[lo, hi],
               capsize=3, label=name)
    ax.set_xticks(x, [str(r["tokens"]) for r in results])
    ax.set_xlabel("tokens in the batch")
    ax.set_ylabel("median latency (ms), p10-p90 bars")
    c = report["config"]
    ax.set_title(f"{c['model']} x{c['layers']} layers, TP={c['tp']}, "
                 f"{report['environment']['device_kind']}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad arguments raises ``SystemExit``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    platform, devices = platform_devices()
    resolve_args(args, platform, len(devices), parser)
    try:
        report = run(args, devices, parser)
    except VerificationError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(describe(report))
    for r in report["results"]:
        if r["rel_err_weave_vs_baseline"] is not None:
            print(f"  T={r['tokens']}: weave vs baseline relative error "
                  f"{r['rel_err_weave_vs_baseline']:.2e} (tolerance {args.tol:.0e}); "
                  f"weave comm: {r['weave_comm']}")
    print(format_table(report))
    print("speedup = baseline / schedule (higher is better); weave/nocomm = 1.00 when all "
          "communication is hidden")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
