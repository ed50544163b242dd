"""The main job and the benchmarks' helpers; importing any of them sets nothing.

``python -m jax_tokenweave.bench`` runs the main job (``bench.job``, ``bench.report``);
``benchmarking``, ``modes``, ``timing`` and ``hlo_check`` serve it and ``benchmarks/*.py``.
The modules' roles: docs/PACKAGE.md#bench.
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
