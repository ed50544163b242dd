"""Fused column-parallel projections: one GEMM for q/k/v and one for gate/up, exact under TP.

Fused columns are rank-blocked for TP degree N (``[q_0|k_0|v_0|q_1|...]``), so ``P(None, "tp")``
gives each rank its own heads and columns. The layout depends on N: convert with
:func:`fuse_weights` / :func:`unfuse_weights`. The layout in full: docs/WEAVE.md#nnfused_layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jax_tokenweave.config import DecoderConfig

FUSED_PARAMS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "qkv_bias": ("q_bias", "k_bias", "v_bias"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
"""Fused parameter name -> the logical (Hugging Face-like) parameters it concatenates."""

PART_OF: dict[str, str] = {part: fused for fused, parts in FUSED_PARAMS.items() for part in parts}


def part_widths(config: DecoderConfig, name: str) -> tuple[int, ...]:
    """Global output widths of the parts of fused parameter ``name``."""
    d = config.head_dim
    if name in ("qkv_proj", "qkv_bias"):
        return config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d
    if name == "gate_up_proj":
        return config.intermediate_size, config.intermediate_size
    raise ValueError(f"{name!r} is not a fused parameter; fused: {sorted(FUSED_PARAMS)}")


@dataclasses.dataclass(frozen=True)
class Segment:
    """Columns ``[fused_start, fused_start + length)`` of the fused array are columns
    ``[part_start, part_start + length)`` of part ``part``."""

    part: int
    part_start: int
    fused_start: int
    length: int


def segments(widths: Sequence[int], tp: int) -> list[Segment]:
    """The rank-blocked layout of parts of global ``widths`` at TP degree ``tp``, in fused
    column order."""
    for w in widths:
        if w % tp:
            raise ValueError(f"part width {w} is not divisible by the TP degree {tp}")
    out, col = [], 0
    for r in range(tp):
        for p, w in enumerate(widths):
            out.append(Segment(p, r * (w // tp), col, w // tp))
            col += w // tp
    return out


def fuse_columns(parts: Sequence[Any], tp: int) -> Any:
    """Parts ``[..., w_p]`` (NumPy or JAX arrays) -> the rank-blocked fused ``[..., sum w_p]``."""
    xp = np if all(isinstance(p, np.ndarray) for p in parts) else _jnp()
    blocks = [
        parts[s.part][..., s.part_start : s.part_start + s.length]
        for s in segments([p.shape[-1] for p in parts], tp)
    ]
    return xp.concatenate(blocks, axis=-1)


def split_columns(fused: Any, widths: Sequence[int], tp: int) -> list[Any]:
    """Inverse of :func:`fuse_columns`: the parts of global ``widths``."""
    if fused.shape[-1] != sum(widths):
        raise ValueError(f"fused width {fused.shape[-1]} differs from the parts' {sum(widths)}")
    xp = np if isinstance(fused, np.ndarray) else _jnp()
    pieces: list[list[Any]] = [[] for _ in widths]
    for s in segments(widths, tp):
        pieces[s.part].append(fused[..., s.fused_start : s.fused_start + s.length])
    return [xp.concatenate(p, axis=-1) for p in pieces]


def fuse_names(
    values: Mapping[str, Any], combine: Callable[[str, list[Any]], Any]
) -> dict[str, Any]:
    """``values`` with every complete group of logical parts (e.g. ``layers.0.q_proj``,
    ``layers.0.k_proj``, ``layers.0.v_proj``) replaced by ``combine(fused leaf name, the parts'
    values in order)`` under the fused name (``layers.0.qkv_proj``); other names unchanged. A
    group given in part raises ``ValueError``."""
    out: dict[str, Any] = {}
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for name, value in values.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in PART_OF:
            groups.setdefault((prefix, PART_OF[leaf]), {})[leaf] = value
        else:
            out[name] = value
    for (prefix, fused), given in groups.items():
        parts = FUSED_PARAMS[fused]
        missing = [p for p in parts if p not in given]
        dotted = f"{prefix}." if prefix else ""
        if missing:
            raise ValueError(
                f"{dotted}{fused} is fused from {parts}; {[dotted + m for m in missing]} missing"
            )
        out[dotted + fused] = combine(fused, [given[p] for p in parts])
    return out


def fuse_weights(weights: Mapping[str, Any], tp: int) -> dict[str, Any]:
    """``weights`` (NumPy or JAX arrays) with the logical parts fused for TP ``tp``
    (:func:`fuse_names`, :func:`fuse_columns`)."""
    return fuse_names(weights, lambda _, parts: fuse_columns(parts, tp))


def unfuse_weights(weights: Mapping[str, Any], config: DecoderConfig, tp: int) -> dict[str, Any]:
    """``weights`` with every fused parameter (laid out for TP ``tp``) replaced by its parts."""
    out: dict[str, Any] = {}
    for name, value in weights.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf not in FUSED_PARAMS:
            out[name] = value
            continue
        dotted = f"{prefix}." if prefix else ""
        parts = split_columns(value, part_widths(config, leaf), tp)
        out.update({dotted + p: v for p, v in zip(FUSED_PARAMS[leaf], parts, strict=True)})
    return out


def _jnp() -> Any:
    import jax.numpy as jnp

    return jnp
