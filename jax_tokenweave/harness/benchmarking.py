"""Helpers shared by the main job (``harness.job``) and ``benchmarks/*.py``.

Importing it sets nothing; entry points call :func:`use_cpu_devices` first in ``main``.
Re-exports the command lines' argument types, help format and engine options
(``serving.cli``). Mode names (``baseline``, ``nocomm``, ``weave-<collective>``, ``-nosplit``):
See docs/PACKAGE.md#harnessbenchmarking.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import os
import platform as _platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_tokenweave.harness.modes import (
    Mode as Mode,  # re-exported: the benchmarks' mode vocabulary
)
from jax_tokenweave.harness.modes import compile_forward as compile_forward
from jax_tokenweave.harness.modes import make_plan as make_plan
from jax_tokenweave.nn.decoder import WeaveDecoder
from jax_tokenweave.serving.cli import DTYPES as DTYPES  # re-exported: the command lines' helpers
from jax_tokenweave.serving.cli import ENGINE_OPTIONS as ENGINE_OPTIONS
from jax_tokenweave.serving.cli import HelpFormatter as HelpFormatter
from jax_tokenweave.serving.cli import add_collective_option as add_collective_option
from jax_tokenweave.serving.cli import add_engine_options as add_engine_options
from jax_tokenweave.serving.cli import config_names_help as config_names_help
from jax_tokenweave.serving.cli import engine_options as engine_options
from jax_tokenweave.serving.cli import load_config as load_config
from jax_tokenweave.serving.cli import nonnegative_int as nonnegative_int
from jax_tokenweave.serving.cli import positive_float as positive_float
from jax_tokenweave.serving.cli import positive_int as positive_int
from jax_tokenweave.serving.cli import positive_ints as positive_ints
from jax_tokenweave.serving.cli import use_cpu_devices as use_cpu_devices
from jax_tokenweave.weave.schedules import COLLECTIVES as COLLECTIVES  # re-exported: modes' names
from jax_tokenweave.weave.schedules import SCHEDULES as SCHEDULES

CPU_DEVICES = 8
# Relative (Frobenius) error allowed between weave and baseline outputs, by dtype.
TOLERANCE = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 1e-4}
PLOT_HINT = "needs matplotlib: pip install 'jax-tokenweave[plot]'"
CPU_NOTE = (
    "note: these are CPU timings. The virtual CPU devices share one host and its memory, "
    "so they say nothing about overlapping GPU communication with compute; run on GPUs "
    "to measure TokenWeave."
)


# ------------------------------------------------------------------------------- set-up ---


def start_devices(count: int = CPU_DEVICES) -> tuple[str, list[jax.Device]]:
    """An entry point's first JAX call: :func:`use_cpu_devices` (its note printed to stderr),
    then :func:`platform_devices`. Started by ``python -m jax_tokenweave.launch`` (one process
    per device), it joins the other processes first (one CPU device each in ``--cpu`` mode), and
    every process but the first prints nothing to stdout."""
    from jax_tokenweave import launch

    if any(os.environ.get(k) for k in launch.ENV_VARS):
        use_cpu_devices(1)
        launch.initialize()
        if jax.process_index() != 0:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the process's lifetime)
        return platform_devices()
    note = use_cpu_devices(count)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return platform_devices()


def is_lead() -> bool:
    """Whether this process writes results (the first one; the only one when run alone)."""
    return jax.process_index() == 0


def number_or_dash(x: float | None, digits: int = 1) -> str:
    """``x`` with ``digits`` decimals for a report's table, ``-`` where it is None."""
    return "-" if x is None else f"{x:.{digits}f}"


def matplotlib_missing() -> str | None:
    """:data:`PLOT_HINT` where matplotlib cannot be imported, else None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return PLOT_HINT
    return None


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
        raise ValueError(
            f"tp={tp} needs 1..{len(devices)} devices; this machine has {len(devices)}"
        )
    return Mesh(np.array(list(devices)[:tp]), (axis_name,))


def request_lengths(tokens: int, request_len: int) -> tuple[int, ...]:
    """``tokens`` packed as requests of ``request_len`` (the last one shorter if need be)."""
    if tokens < 1 or request_len < 1:
        raise ValueError(f"need tokens >= 1 and request_len >= 1, got {tokens}, {request_len}")
    full, rest = divmod(tokens, request_len)
    return (request_len,) * full + ((rest,) if rest else ())


def build_decoder(config: Any, mesh: Mesh, dtype: Any, seed: int) -> Any:
    """A ``WeaveDecoder`` with fresh random weights (``nnx.Rngs(seed)``)."""
    return WeaveDecoder(config, mesh, dtype=dtype, rngs=nnx.Rngs(seed))


def global_array(mesh: Mesh, data: np.ndarray, spec: PartitionSpec) -> jax.Array:
    """``data`` (the same in every process) sharded over ``mesh`` by ``spec``; each process
    places only its own devices' pieces (one process per device works too)."""
    return jax.make_array_from_callback(
        data.shape, NamedSharding(mesh, spec), lambda idx: data[idx]
    )


def local_data(x: jax.Array) -> np.ndarray:
    """This process's shards of ``x`` as float64, in device order, stacked on axis 0."""
    return np.concatenate([np.asarray(s.data, np.float64) for s in x.addressable_shards])


def random_hidden(num_tokens: int, hidden: int, dtype: Any, mesh: Mesh, seed: int) -> jax.Array:
    """Random normal hidden states ``[T, H]``, replicated over ``mesh``."""
    x = jax.random.normal(jax.random.key(seed), (num_tokens, hidden), jnp.float32).astype(dtype)
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))


def resolve_seed() -> int:
    """A fresh random seed from the OS (recorded in the results so a run can be replayed);
    with several processes, the first one's (they must build the same model)."""
    entropy = np.random.SeedSequence().entropy
    assert isinstance(entropy, int)  # given no entropy, SeedSequence draws an int from the OS
    seed = entropy % (2**31)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        seed = int(multihost_utils.broadcast_one_to_all(np.int64(seed)))
    return seed


# --------------------------------------------------------------------------- environment ---


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
            head = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "HEAD"],
                check=True,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "-uno"],
                check=True,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        return head + ("+dirty" if dirty else "")
    return None


def environment(devices: Sequence[jax.Device], command: Sequence[str]) -> dict[str, Any]:
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
        "command": " ".join([Path(sys.executable).name, *command]),
        "env": {
            k: os.environ[k] for k in sorted(os.environ) if k.startswith(("XLA_", "JAX_", "NCCL_"))
        },
    }


# ------------------------------------------------------------------------------ arguments ---


def add_run_options(parser: argparse.ArgumentParser, *, warmup: int, iters: int, unit: str) -> None:
    """``--warmup``, ``--iters`` and ``--dtype``, as the benchmark scripts share them."""
    parser.add_argument(
        "--warmup", type=nonnegative_int, default=warmup, help=f"untimed calls per {unit}"
    )
    parser.add_argument(
        "--iters",
        type=positive_int,
        default=iters,
        help=f"timed calls per {unit} (the median is reported)",
    )
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default="bfloat16", help="parameter and activation dtype"
    )


def add_sweep_options(parser: argparse.ArgumentParser, *, plot: str) -> None:
    """``--seed``, ``--time-budget`` and ``--no-plot`` (of the ``plot`` file), as the sweeping
    benchmark scripts share them."""
    parser.add_argument("--seed", type=nonnegative_int, help="random seed (default: fresh)")
    parser.add_argument(
        "--time-budget",
        type=positive_float,
        metavar="SECONDS",
        help="start no new measurement after this many seconds (default: no limit)",
    )
    parser.add_argument(
        "--no-plot",
        action="store_true",
        help=f"write no {plot} (the plot needs matplotlib: the plot extra)",
    )


class Flatten(argparse.Action):
    """For ``nargs="+"`` options whose type returns lists (:func:`positive_ints`):
    ``--tp 2 4`` or ``--tp 2,4`` -> ``[2, 4]``, repeats dropped, order kept."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        flat = [v for group in values for v in (group if isinstance(group, list) else [group])]
        setattr(namespace, self.dest, list(dict.fromkeys(flat)))


def result_parser(prog: str, doc: str, stem: str) -> argparse.ArgumentParser:
    """A benchmark's parser with the shared head: description from ``doc``'s first paragraph,
    the defaults-showing help, a required ``--out DIR`` for ``<stem>.json/.md/.png`` and
    ``--layers``."""
    p = argparse.ArgumentParser(
        prog=prog, description=doc.split("\n\n")[0], formatter_class=HelpFormatter
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help=f"folder for {stem}.json, {stem}.md and {stem}.png",
    )
    p.add_argument("--layers", type=positive_int, default=8, help="decoder layers to stack")
    return p


@functools.cache
def sibling_module(anchor: str, name: str) -> ModuleType:
    """``<name>.py`` beside the file ``anchor`` (a benchmark's ``__file__``), loaded by path once
    (benchmarks/ is no package, and ``python -P`` leaves the script's folder off the path)."""
    if (loaded := sys.modules.get(f"_benchmarks_{name}")) is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(
        f"_benchmarks_{name}", Path(anchor).with_name(f"{name}.py")
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {name}.py beside {anchor}")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
