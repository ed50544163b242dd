"""``allreduce_rmsnorm``: sum partials over a mesh axis, add the residual, apply RMSNorm.

Runs inside ``jax.shard_map`` over a 1-D TP axis of size N; shapes are per rank. ``impl``: ``xla``,
``ffi_replicated`` (residual replicated [T, H]), ``xla_rsag``, ``ffi``, ``auto`` (residual
token-sharded [q, H], ``q = rows_per_rank(T, N) = ceil(T / N)``). ``ffi_replicated`` is the fused
kernel exchanging no residual rows, for decode sizes (T <= its CTAs, rows of at most 16 KiB).
``normed`` is always [T, H] replicated; RMSNorm math is float32, outputs in the input dtype. The
impls and padding rows: docs/KERNEL.md#kernelops.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jax_tokenweave.kernel._util import ceil_div

Impl = Literal["auto", "xla", "xla_rsag", "ffi", "ffi_replicated"]
IMPLS: tuple[str, ...] = get_args(Impl)
SHARDED_RESIDUAL_IMPLS = ("auto", "xla_rsag", "ffi")


def rows_per_rank(num_tokens: int, axis_size: int) -> int:
    """Rows of the token-sharded residual each rank holds: ``ceil(num_tokens / axis_size)``."""
    if num_tokens < 1 or axis_size < 1:
        raise ValueError(f"need num_tokens >= 1 and axis_size >= 1, got {num_tokens}, {axis_size}")
    return ceil_div(num_tokens, axis_size)


def residual_rows(num_tokens: int, axis_size: int, impl: str) -> int:
    """Rows of the residual that ``allreduce_rmsnorm(..., impl=impl)`` expects per rank."""
    _check_impl(impl)
    return rows_per_rank(num_tokens, axis_size) if impl in SHARDED_RESIDUAL_IMPLS else num_tokens


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis in float32; ``x``: [..., H], ``weight``: [H]; returns x.dtype."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * weight.astype(jnp.float32)).astype(x.dtype)


def add_rmsnorm(
    x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float
) -> tuple[jax.Array, jax.Array]:
    """``(rms_norm(x + residual), x + residual)``, the add done in float32, both in x.dtype."""
    summed = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
    return rms_norm(summed, weight, eps), summed


def allreduce_rmsnorm(
    partial: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    *,
    axis_name: str,
    eps: float = 1e-6,
    impl: Impl = "auto",
    mesh: Mesh | None = None,
    num_ctas: int | None = None,
    slot: int = 0,
    algo: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """RMSNorm(sum over ``axis_name`` of ``partial`` + ``residual``) and the new residual.

    ``partial`` [T, H]: this rank's partial sum; ``residual`` [T, H] for ``impl="xla"`` and
    ``"ffi_replicated"``, else [ceil(T/N), H] token-sharded; ``weight`` [H] replicated; ``eps``;
    ``axis_name``: the TP axis (inside ``shard_map``); ``impl``: module docstring. ``mesh``:
    needed by ``ffi`` and ``ffi_replicated`` (and by ``auto`` to consider it). ``num_ctas``,
    ``slot``, ``algo``: the fused kernel's thread blocks (None: tuned), workspace slot (calls
    in flight at once need different ones) and variant (``auto``: the size policy's; ``ce``:
    copy engines). Returns ``(normed [T, H] replicated, residual_out)``.
    """
    _check_impl(impl)
    axis_size = jax.lax.axis_size(axis_name)
    _check_inputs(partial, residual, weight, axis_size, impl)
    if impl == "auto":  # one device has nothing to reduce: XLA's own add + norm fusion
        usable = axis_size > 1 and _unavailable_reason(partial, axis_name, mesh) is None
        impl = "ffi" if usable else "xla_rsag"
    if impl == "xla":
        summed = jax.lax.psum(partial, axis_name)
        return add_rmsnorm(summed, residual, weight, eps)
    if impl == "xla_rsag":
        return _xla_rsag(partial, residual, weight, axis_name, axis_size, eps)
    reason = _unavailable_reason(partial, axis_name, mesh)
    if reason is not None:
        raise RuntimeError(f"allreduce_rmsnorm(impl={impl!r}) is unavailable: {reason}")
    from jax_tokenweave.kernel import _ffi

    return _ffi.allreduce_rmsnorm(
        partial,
        residual,
        weight,
        axis_name=axis_name,
        mesh=mesh,
        eps=eps,
        num_ctas=num_ctas,
        slot=slot,
        algo=algo,
        residual_replicated=impl == "ffi_replicated",
    )


def _xla_rsag(
    partial: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    axis_name: str,
    axis_size: int,
    eps: float,
) -> tuple[jax.Array, jax.Array]:
    num_tokens = partial.shape[0]
    padded = rows_per_rank(num_tokens, axis_size) * axis_size
    if padded != num_tokens:
        partial = jnp.pad(partial, ((0, padded - num_tokens), (0, 0)))
    own = jax.lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True)
    normed_own, residual_out = add_rmsnorm(own, residual, weight, eps)
    normed = jax.lax.all_gather(normed_own, axis_name, axis=0, tiled=True)
    return normed[:num_tokens], residual_out


def _unavailable_reason(partial: jax.Array, axis_name: str, mesh: Mesh | None) -> str | None:
    from jax_tokenweave.kernel import _ffi

    return _ffi.unavailable_reason(mesh, axis_name, partial.dtype, partial.shape)


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _check_inputs(
    partial: jax.Array, residual: jax.Array, weight: jax.Array, axis_size: int, impl: str
) -> None:
    if partial.ndim != 2:
        raise ValueError(f"partial must be [tokens, hidden], got shape {partial.shape}")
    num_tokens, hidden = partial.shape
    if num_tokens == 0:
        raise ValueError("partial has no tokens (empty batch)")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {weight.shape}")
    want = (residual_rows(num_tokens, axis_size, impl), hidden)
    if residual.shape != want:
        layout = "token-sharded" if impl in SHARDED_RESIDUAL_IMPLS else "replicated"
        raise ValueError(
            f"impl={impl!r} expects a {layout} residual of shape {want} per rank for "
            f"{num_tokens} tokens over an axis of size {axis_size}; got {residual.shape}"
        )
    if residual.dtype != partial.dtype:
        raise ValueError(
            f"residual dtype {residual.dtype} differs from partial dtype {partial.dtype}"
        )
    for name, array in (("partial", partial), ("weight", weight)):
        if not jnp.issubdtype(array.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {array.dtype}")
