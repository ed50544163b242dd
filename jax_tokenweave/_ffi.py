"""Placeholder until the CUDA extension lands: the fused kernel is never available."""

from __future__ import annotations


def unavailable_reason(mesh, axis_name, dtype, shape) -> str | None:
    return "the jax-tokenweave CUDA extension is not part of this build yet"
