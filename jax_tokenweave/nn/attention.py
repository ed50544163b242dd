"""RoPE and ragged causal attention over packed requests, per tensor-parallel rank.

Arrays are ``[tokens, heads, head_dim]``, heads local to the rank (GQA where Nq != Nkv). A
query attends causally within its request; a piece with ``position > 0`` also attends to a
passed-in prefix K/V. ``JAX_TOKENWEAVE_ATTENTION=xla|cudnn|auto`` overrides
``default_implementation``; ``reference_attention`` is a float64 NumPy reference.
Batching and the cuDNN fallback: docs/WEAVE.md#nnattention.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jax_tokenweave.config import RopeScaling


class PieceLike(Protocol):
    """What attention needs of ``weave.plan.Piece``: global start, length, position in its
    request."""

    @property
    def request(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def position(self) -> int: ...


# ---------------------------------------------------------------------------------------- RoPE


def rope_inv_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` (float64), with Llama-3 scaling when given.

    Llama-3 scaling keeps high frequencies (wavelength < original_max / high_freq_factor), divides
    low ones (wavelength > original_max / low_freq_factor) by ``factor`` and interpolates
    linearly in ``original_max / wavelength`` between the two.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be positive and even, got {head_dim}")
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv
    wavelen = 2.0 * math.pi / inv
    old = float(scaling.original_max_position_embeddings)
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    scaled = inv / scaling.factor
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mixed = (1.0 - smooth) * scaled + smooth * inv
    out = np.where(wavelen > low_wavelen, scaled, inv)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, mixed, out)


def apply_rope(x: jax.Array, positions: jax.Array | np.ndarray, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x [T, heads, head_dim]`` by ``positions [T]`` (Hugging Face "rotate half" layout).

    The first and second halves of ``head_dim`` form the (real, imaginary) pairs. Math in
    float32; returns ``x.dtype``.
    """
    angles = jnp.asarray(positions, jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def reference_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Float64 NumPy version of ``apply_rope``."""
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = np.split(np.asarray(x, np.float64), 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ----------------------------------------------------------------------------------- attention

Implementation = Literal["xla", "cudnn"]
"""``jax.nn.dot_product_attention``'s implementations this module asks for (None: XLA)."""

IMPL_ENV = "JAX_TOKENWEAVE_ATTENTION"
"""Environment override of :func:`default_implementation`: ``xla``, ``cudnn`` or ``auto``."""


def default_implementation(platform: str, dtype: jnp.dtype, head_dim: int) -> Implementation | None:
    """``"cudnn"`` where cuDNN's fused attention is likely to take the call, else None (XLA).

    ``JAX_TOKENWEAVE_ATTENTION=xla`` (or ``cudnn``) in the environment forces the choice.
    """
    forced = os.environ.get(IMPL_ENV, "auto").strip().lower()
    if forced not in ("auto", "xla", "cudnn"):
        raise ValueError(f"{IMPL_ENV} must be auto, xla or cudnn; got {forced!r}")
    if forced != "auto":
        return None if forced == "xla" else "cudnn"
    if (
        platform in ("gpu", "cuda")
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim % 8 == 0
        and head_dim <= 128
    ):
        return "cudnn"
    return None


def _sdpa(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    is_causal: bool,
    mask: jax.Array | None,
    implementation: Implementation | None,
) -> jax.Array:
    """``jax.nn.dot_product_attention`` on [B, T, N, D]; cuDNN refusals fall back to XLA."""
    if implementation == "cudnn":
        try:
            return jax.nn.dot_product_attention(
                q, k, v, mask=mask, scale=scale, is_causal=is_causal, implementation="cudnn"
            )
        except (ValueError, RuntimeError, NotImplementedError, TypeError):
            implementation = None
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=is_causal, implementation=implementation
    )


def _check_attention_inputs(
    q: jax.Array, k: jax.Array, v: jax.Array, pieces: Sequence[PieceLike], origin: int
) -> None:
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(
            f"q, k, v must be [tokens, heads, head_dim]; got {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"inconsistent q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})"
        )
    expected = origin
    for piece in pieces:
        if piece.start != expected or piece.length < 1:
            raise ValueError(
                f"pieces must be contiguous from {origin} with length >= 1; got {pieces}"
            )
        expected += piece.length
    if expected - origin != q.shape[0]:
        raise ValueError(f"pieces cover {expected - origin} tokens, q has {q.shape[0]}")


def _group_pieces(pieces: Sequence[PieceLike]) -> dict[int, list[int]]:
    """Indices of the prefix-free pieces, grouped by length."""
    groups: dict[int, list[int]] = {}
    for index, piece in enumerate(pieces):
        if piece.position == 0:
            groups.setdefault(piece.length, []).append(index)
    return groups


def _adjacent(starts: Sequence[int], length: int) -> bool:
    """Whether pieces of ``length`` rows starting at ``starts`` follow each other."""
    return all(s == starts[0] + i * length for i, s in enumerate(starts))


def _stack_rows(x: jax.Array, starts: Sequence[int], length: int) -> jax.Array:
    """[n, length, ...] from rows ``[s, s+length)`` of x for each start: a reshape if adjacent."""
    n = len(starts)
    if _adjacent(starts, length):
        return x[starts[0] : starts[0] + n * length].reshape((n, length, *x.shape[1:]))
    return jnp.stack([x[s : s + length] for s in starts])


def ragged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pieces: Sequence[PieceLike],
    *,
    origin: int = 0,
    prefix: Mapping[int, tuple[jax.Array, jax.Array]] | None = None,
    scale: float | None = None,
    implementation: Implementation | None = None,
) -> jax.Array:
    """Causal attention of packed request pieces, one rank's heads.

    ``q`` [T, Nq, D] (RoPE applied, T the pieces' total length); ``k``, ``v`` [T, Nkv, D] (Nq a
    multiple of Nkv). ``pieces``: in token order, ``piece.start - origin`` the first row;
    ``origin``: global index of row 0 (the half's ``start``). ``prefix``: per piece with ``position
    > 0``, by ``request``, its earlier K/V ``([position, Nkv, D], [position, Nkv, D])``. ``scale``:
    default ``1/sqrt(D)``. ``implementation``: None (XLA) or ``"cudnn"`` (XLA where refused).
    Returns [T, Nq, D] in q's dtype.
    """
    _check_attention_inputs(q, k, v, pieces, origin)
    prefix = dict(prefix or {})
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    blocks: list[tuple[int, jax.Array]] = []  # (first row, output rows), in any order
    for length, indices in _group_pieces(pieces).items():
        starts = [pieces[i].start - origin for i in indices]
        out = _sdpa(
            _stack_rows(q, starts, length),
            _stack_rows(k, starts, length),
            _stack_rows(v, starts, length),
            scale=scale,
            is_causal=True,
            mask=None,
            implementation=implementation,
        )
        if _adjacent(starts, length):  # one block: no slicing apart and joining back
            blocks.append((starts[0], out.reshape(len(starts) * length, *out.shape[2:])))
        else:
            blocks.extend(zip(starts, out, strict=True))
    for piece in pieces:
        if piece.position > 0:
            blocks.append(
                (
                    piece.start - origin,
                    _prefix_piece_attention(q, k, v, piece, origin, prefix, scale, implementation),
                )
            )
    blocks.sort(key=lambda block: block[0])
    return jnp.concatenate([b for _, b in blocks], axis=0) if len(blocks) > 1 else blocks[0][1]


def _prefix_piece_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    piece: PieceLike,
    origin: int,
    prefix: Mapping[int, tuple[jax.Array, jax.Array]],
    scale: float,
    implementation: Implementation | None,
) -> jax.Array:
    """One piece attending to [prefix K/V, its own K/V], bottom-right aligned causal mask."""
    if piece.request not in prefix:
        raise ValueError(
            f"piece {piece} has position > 0 but no prefix K/V was given for "
            f"request {piece.request}"
        )
    k_pre, v_pre = prefix[piece.request]
    if k_pre.shape != (piece.position, *k.shape[1:]) or v_pre.shape != k_pre.shape:
        raise ValueError(
            f"prefix K/V of request {piece.request} must have shape "
            f"{(piece.position, *k.shape[1:])}; got {k_pre.shape}, {v_pre.shape}"
        )
    lo, hi = piece.start - origin, piece.start - origin + piece.length
    keys = jnp.concatenate([k_pre.astype(k.dtype), k[lo:hi]], axis=0)
    values = jnp.concatenate([v_pre.astype(v.dtype), v[lo:hi]], axis=0)
    mask = causal_mask(piece.length, piece.position + piece.length)
    out = _sdpa(
        q[None, lo:hi],
        keys[None],
        values[None],
        scale=scale,
        is_causal=False,
        mask=jnp.asarray(mask)[None, None],
        implementation=implementation,
    )
    return out[0]


def causal_mask(num_queries: int, num_keys: int) -> np.ndarray:
    """Bottom-right aligned causal mask ``[num_queries, num_keys]``: query i sees keys
    ``j <= i + num_keys - num_queries`` (the queries are the last ``num_queries`` positions)."""
    rows = np.arange(num_queries)[:, None] + (num_keys - num_queries)
    return np.arange(num_keys)[None, :] <= rows


def reference_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    request_lengths: Sequence[int],
    scale: float | None = None,
) -> np.ndarray:
    """Float64 dense masked attention over the whole packed batch: [T, Nq, D] -> [T, Nq, D].

    Token i attends to token j iff they belong to the same request and j <= i.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    segment = np.repeat(np.arange(len(request_lengths)), request_lengths)
    index = np.arange(q.shape[0])
    allowed = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
    logits = np.einsum("tnd,snd->nts", q, k) * scale
    logits = np.where(allowed[None], logits, -np.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("nts,snd->tnd", probs, v)
