"""The main job and the benchmarks' helpers.

``python -m jax_tokenweave.bench`` runs the main job (``bench.job``: times the decoder stack's
schedules side by side; ``bench.report``: its table, header line and plot).

- ``benchmarking``: helpers shared by the main job and ``benchmarks/*.py`` (devices, meshes,
  random models and inputs, the run's environment, the benchmarks' options);
- ``modes``: benchmark modes (schedule, collective, split, CTAs) and their measurement;
- ``timing``: blocking timers, interleaved medians, relative errors;
- ``hlo_check``: checks a compiled program for the fused kernel's start/done overlap.

Importing any of them sets nothing (no environment variable, no JAX config).
"""

from __future__ import annotations

from typing import Any

from jax_tokenweave._legacy import renamed_attribute

# The main job was the module jax_tokenweave.bench until 0.2.0: its names, for one release.
_RENAMED = {
    **{
        name: f"jax_tokenweave.bench.job:{name}"
        for name in (
            "CPU_DEFAULTS",
            "GPU_DEFAULTS",
            "PROG",
            "Defaults",
            "VerificationError",
            "build_parser",
            "main",
            "resolve_args",
            "run",
        )
    },
    **{
        name: f"jax_tokenweave.bench.report:{name}"
        for name in ("describe", "format_table", "write_plot")
    },
}


def __getattr__(name: str) -> Any:
    return renamed_attribute(__name__, name, _RENAMED)
