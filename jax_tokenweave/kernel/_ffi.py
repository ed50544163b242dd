"""The fused AllReduce + residual + RMSNorm kernel as JAX operations (XLA FFI custom calls).

The handlers live in the CUDA extension (:mod:`jax_tokenweave.kernel._extension`); this
module registers them with ``jax.ffi`` for the CUDA platform and calls them inside
``shard_map``, with the :class:`~jax_tokenweave.kernel.comm.Communicator` of the mesh axis
(``comm=``, or the shared one of ``mesh``/``axis_name``). The synchronous call is
command-buffer compatible; the start/done pair is not (it forks onto a side stream in one
custom call and joins in another).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_tokenweave.kernel import _extension
from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.kernel.comm import Communicator, get_communicator

TARGETS = {
    "allreduce_rmsnorm": "tokenweave_allreduce_rmsnorm",
    "allreduce_rmsnorm_uncaptured": "tokenweave_allreduce_rmsnorm_uncaptured",
    "allreduce_rmsnorm_start": "tokenweave_allreduce_rmsnorm_start",
    "allreduce_rmsnorm_done": "tokenweave_allreduce_rmsnorm_done",
}

_lock = threading.Lock()
_registered = False
import_error = _extension.import_error


def register_targets() -> bool:
    """Registers the FFI targets for the CUDA platform once; False where the extension is absent."""
    global _registered
    if _extension.import_error() is not None:
        return False
    with _lock:
        if not _registered:
            for key, capsule in _extension.get().handlers().items():
                jax.ffi.register_ffi_target(TARGETS[key], capsule, platform="CUDA")
            _registered = True
    return True


def _communicator(comm: Communicator | None, mesh: Mesh | None, axis_name: str) -> Communicator:
    if comm is not None:
        return comm
    if mesh is None:
        raise RuntimeError(
            "the fused allreduce_rmsnorm kernel is unavailable: it needs the "
            "concrete mesh (pass mesh=... or comm=...)"
        )
    return get_communicator(mesh, axis_name)


def unavailable_reason(
    mesh: Mesh | None,
    axis_name: str,
    dtype,
    shape,
    *,
    num_ctas: int | None = None,
    slot: int = 0,
    algo: str = "auto",
    residual_replicated: bool = False,
) -> str | None:
    """None where the fused kernel can run on ``mesh``'s ``axis_name`` for per-rank ``shape``
    [T, H] of ``dtype``; otherwise one sentence saying why (the shared communicator's view)."""
    if mesh is None:
        return "impl='ffi' needs the concrete mesh (pass mesh=...)"
    if axis_name not in mesh.axis_names:
        return f"axis {axis_name!r} is not an axis of the mesh {mesh.axis_names}"
    return get_communicator(mesh, axis_name).unavailable_reason(
        dtype,
        shape,
        num_ctas=num_ctas,
        slot=slot,
        algo=algo,
        residual_replicated=residual_replicated,
    )


def replicated_reason(
    mesh: Mesh | None,
    axis_name: str,
    dtype,
    shape,
    *,
    num_ctas: int | None = None,
    slot: int = 0,
    algo: str = "auto",
) -> str | None:
    """None where the fused call can take per-rank ``shape`` [T, H] of ``dtype`` with its
    residual replicated ([T, H] on every rank, ``residual_replicated=True``); otherwise why not."""
    why = unavailable_reason(
        mesh,
        axis_name,
        dtype,
        shape,
        num_ctas=num_ctas,
        slot=slot,
        algo="one_shot",
        residual_replicated=True,
    )
    if why is not None:
        return why
    try:
        struct = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
        comm = _communicator(None, mesh, axis_name)  # mesh checked by unavailable_reason
        _replicated_choice(comm, struct, algo, num_ctas)
    except ValueError as e:
        return str(e)
    return None


def _replicated_choice(comm: Communicator, partial, algo: str, num_ctas) -> tuple[str, int]:
    """``(algo, num_ctas)`` of a call whose residual is replicated: the decode one-shot kernel,
    on at least T CTAs (one per row); ValueError where it cannot take the call."""
    if algo not in ("auto", "one_shot"):
        raise ValueError(f"a replicated residual needs algo 'one_shot' (or 'auto'), got {algo!r}")
    tokens, hidden = partial.shape
    _, ctas = comm.choose(partial.dtype, partial.shape, algo="one_shot", num_ctas=num_ctas)
    if num_ctas is None:
        ctas = max(ctas, min(tokens, _extension.limits()["max_oneshot_ctas"]))
    ext = _extension.get()
    dtype = jnp.dtype(partial.dtype).name
    multimem = comm.settings.multimem
    if not ext.residual_replicated_fits(
        comm.axis_size, tokens, hidden, dtype, "one_shot", multimem, ctas
    ):
        raise ValueError(
            f"a replicated residual needs one device or the decode one-shot kernel (T <= "
            f"num_ctas, rows of at most 16 KiB, no multimem); got [{tokens}, {hidden}] {dtype} "
            f"on {ctas} CTAs over {comm.axis_size} devices"
        )
    return "one_shot", ctas


def _prepare(comm: Communicator, partial, residual, weight, num_ctas, slot, algo, replicated=False):
    if num_ctas is not None:
        lim = _extension.limits()
        top = max(lim["max_ctas"], lim["max_oneshot_ctas"], lim.get("max_ce_ctas", 0))
        if not lim["min_ctas"] <= int(num_ctas) <= top:
            raise ValueError(f"num_ctas must be in [{lim['min_ctas']}, {top}], got {num_ctas}")
    reason = comm.unavailable_reason(  # a replicated residual runs one-shot (buffer bytes)
        partial.dtype,
        partial.shape,
        num_ctas=num_ctas,
        slot=slot,
        algo="one_shot" if replicated and algo == "auto" else algo,
        residual_replicated=replicated,
    )
    if reason is not None:
        raise RuntimeError(f"the fused allreduce_rmsnorm kernel is unavailable: {reason}")
    register_targets()
    rows = partial.shape[0] if replicated else ceil_div(partial.shape[0], comm.axis_size)
    if residual.shape != (rows, partial.shape[1]):
        layout = "replicated" if replicated else "token-sharded"
        raise ValueError(
            f"residual must be {layout} {(rows, partial.shape[1])}, got {residual.shape}"
        )
    if replicated:
        algo, num_ctas = _replicated_choice(comm, partial, algo, num_ctas)
    else:
        algo, num_ctas = comm.choose(partial.dtype, partial.shape, algo=algo, num_ctas=num_ctas)
    attrs = dict(
        comm_id=np.int64(comm.comm_id),
        slot=np.int32(slot),
        num_ctas=np.int32(num_ctas),
        algo=np.int32(_extension.limits()["algos"][algo]),  # the extension's own ids
        residual_replicated=np.int32(replicated),
    )
    outs = (
        jax.ShapeDtypeStruct(partial.shape, partial.dtype),
        jax.ShapeDtypeStruct(residual.shape, residual.dtype),
    )
    # The kernel reads the weight in the rows' dtype or in float32 (no convert kernel per call).
    if weight.dtype not in (partial.dtype, jnp.dtype(jnp.float32)):
        weight = weight.astype(jnp.float32)
    return weight, attrs, outs


def allreduce_rmsnorm(
    partial: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    *,
    axis_name: str,
    mesh: Mesh | None = None,
    eps: float = 1e-6,
    num_ctas: int | None = None,
    slot: int = 0,
    algo: str = "auto",
    comm: Communicator | None = None,
    residual_replicated: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The fused kernel, inside ``shard_map``: same contract as ``ops.allreduce_rmsnorm``
    (partial [T, H], token-sharded residual [ceil(T/N), H], weight [H]) -> (normed [T, H]
    replicated, residual_out). ``algo``: "auto" (the communicator's policy), "one_shot",
    "two_shot" or "direct" (see ffi/README.md); ``num_ctas`` None: the policy's.
    ``residual_replicated``: residual and residual_out are [T, H] on every rank and no residual
    rows are exchanged (the decode one-shot kernel: T <= num_ctas, rows of at most 16 KiB)."""
    comm = _communicator(comm, mesh, axis_name)
    w, attrs, outs = _prepare(
        comm, partial, residual, weight, num_ctas, slot, algo, residual_replicated
    )
    # The copy-engine variant stays out of XLA's command buffers (ffi/README.md says why).
    ce = int(attrs["algo"]) == _extension.limits()["algos"]["ce"]
    call = jax.ffi.ffi_call(
        TARGETS["allreduce_rmsnorm_uncaptured" if ce else "allreduce_rmsnorm"], outs
    )
    return call(partial, residual, w, eps=np.float32(eps), **attrs)


class Pending(NamedTuple):
    """What ``allreduce_rmsnorm_start`` hands to ``allreduce_rmsnorm_done`` (a pytree): the
    not-yet-valid outputs and every buffer the side stream still reads."""

    normed: jax.Array
    residual_out: jax.Array
    partial: jax.Array
    residual: jax.Array
    weight: jax.Array  # the very buffer the kernel reads (float32 or the rows' dtype)


def allreduce_rmsnorm_start(
    partial: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    *,
    axis_name: str,
    mesh: Mesh | None = None,
    eps: float = 1e-6,
    num_ctas: int | None = None,
    slot: int = 0,
    algo: str = "auto",
    comm: Communicator | None = None,
    residual_replicated: bool = False,
) -> Pending:
    """Starts the fused kernel (arguments as ``allreduce_rmsnorm``) on the device's
    high-priority side stream, after everything XLA queued before it, and returns a ``Pending``
    whose outputs are NOT valid yet. Ordering requirements: read the outputs only through
    ``allreduce_rmsnorm_done(pending)``; do not modify or donate anything in ``pending``; at
    most one start per slot may be outstanding (``done`` before the next ``start`` on that
    slot); calls in flight together use different slots. XLA orders by data only: to overlap
    compute with the kernel, pass the compute's input through ``jax.lax.optimization_barrier``
    together with ``pending`` (so it runs after ``start``), and pass ``pending`` and the
    compute's output through another ``optimization_barrier`` before ``done`` (so ``done``
    waits after it)."""
    comm = _communicator(comm, mesh, axis_name)
    w, attrs, outs = _prepare(
        comm, partial, residual, weight, num_ctas, slot, algo, residual_replicated
    )
    call = jax.ffi.ffi_call(TARGETS["allreduce_rmsnorm_start"], outs)
    normed, residual_out = call(partial, residual, w, eps=np.float32(eps), **attrs)
    return Pending(normed, residual_out, partial, residual, w)


def allreduce_rmsnorm_done(
    pending: Pending,
    *,
    axis_name: str,
    mesh: Mesh | None = None,
    slot: int = 0,
    comm: Communicator | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Makes XLA's stream wait for the kernel ``allreduce_rmsnorm_start`` began on ``slot`` and
    returns its ``(normed, residual_out)`` (aliased to the pending buffers). The start's
    operands are passed along so XLA keeps them alive until here."""
    comm = _communicator(comm, mesh, axis_name)
    outs = (
        jax.ShapeDtypeStruct(pending.normed.shape, pending.normed.dtype),
        jax.ShapeDtypeStruct(pending.residual_out.shape, pending.residual_out.dtype),
    )
    call = jax.ffi.ffi_call(
        TARGETS["allreduce_rmsnorm_done"], outs, input_output_aliases={0: 0, 1: 1}
    )
    normed, residual_out = call(*pending, comm_id=np.int64(comm.comm_id), slot=np.int32(slot))
    return normed, residual_out
