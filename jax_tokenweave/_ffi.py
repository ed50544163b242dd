"""Python side of the CUDA extension: loading, FFI target registration, comms, availability.

The extension ``jax_tokenweave._tokenweave_ffi`` (built from ``ffi/`` when nvcc is present) holds
the fused AllReduce + residual + RMSNorm kernel as XLA FFI handlers. This module registers them
with ``jax.ffi`` (for the CUDA platform; harmless on CPU-only jax), builds the "comm" (symmetric
workspace + peer access) for a mesh axis, and says in one sentence why the kernel cannot run
where it cannot, so ``impl="auto"`` falls back to ``xla_rsag``.

Environment:
  ``JAX_TOKENWEAVE_WORKSPACE_MB``  workspace per device, MiB (default 2048), split into slots x 2
                                   epoch parities; a call needs at most one (slot, parity) area.
  ``JAX_TOKENWEAVE_SLOTS``         independent slots (default 4; calls in flight together need
                                   different slots).
  ``JAX_TOKENWEAVE_ONESHOT_BYTES`` auto picks one-shot when T*H*itemsize <= this (default 64 KiB),
                                   direct above.
  ``JAX_TOKENWEAVE_ALGO``          the variant auto runs at every size (two_shot, one_shot, direct).
  ``JAX_TOKENWEAVE_TIMEOUT_S``     barrier wait bound before the kernel traps (default 10 s).
  ``JAX_TOKENWEAVE_MULTIMEM=1``    opt into the multicast (multimem) path; refused where
                                   ``NCCL_NVLS_ENABLE=0``.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

try:
    from jax_tokenweave import _tokenweave_ffi as _ext

    _IMPORT_ERROR: str | None = None
except ImportError as e:  # not built (no nvcc at install time) or broken
    _ext = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

TARGETS = {
    "allreduce_rmsnorm": "tokenweave_allreduce_rmsnorm",
    "allreduce_rmsnorm_start": "tokenweave_allreduce_rmsnorm_start",
    "allreduce_rmsnorm_done": "tokenweave_allreduce_rmsnorm_done",
}
ALGOS = {"auto": 0, "two_shot": 1, "one_shot": 2, "direct": 3}
Algo = Literal["auto", "two_shot", "one_shot", "direct"]
DIRECT_BYTES = 16  # the direct variant's mailbox
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
DEFAULT_NUM_CTAS = 16
MIN_CTAS, MAX_CTAS, MAX_RANKS, MAX_HIDDEN = 2, 32, 8, 16384

_lock = threading.Lock()
_registered = False
_comms: dict[tuple, int] = {}


def import_error() -> str | None:
    """Why the extension did not import (the ImportError text), or None."""
    return _IMPORT_ERROR


def register_targets() -> bool:
    """Registers the FFI targets for the CUDA platform once; False where the extension is absent."""
    global _registered
    if _ext is None:
        return False
    with _lock:
        if not _registered:
            for key, capsule in _ext.handlers().items():
                jax.ffi.register_ffi_target(TARGETS[key], capsule, platform="CUDA")
            _registered = True
    return True


def workspace_bytes() -> int:
    return int(float(os.environ.get("JAX_TOKENWEAVE_WORKSPACE_MB", "2048")) * 2**20)


def num_slots() -> int:
    return int(os.environ.get("JAX_TOKENWEAVE_SLOTS", "4"))


def oneshot_bytes() -> int:
    return int(os.environ.get("JAX_TOKENWEAVE_ONESHOT_BYTES", str(64 * 1024)))


def env_algo() -> str:
    """``JAX_TOKENWEAVE_ALGO``: the variant ``algo="auto"`` runs ("auto" = chosen by size)."""
    algo = os.environ.get("JAX_TOKENWEAVE_ALGO", "auto")
    if algo not in ALGOS:
        raise ValueError(f"JAX_TOKENWEAVE_ALGO must be one of {tuple(ALGOS)}, got {algo!r}")
    return algo


def multimem_requested() -> bool:
    return os.environ.get("JAX_TOKENWEAVE_MULTIMEM") == "1"


def multimem_refusal() -> str | None:
    """None where the multimem path may run; else why not (checked before any multicast call)."""
    if not multimem_requested():
        return "the multimem path is opt-in: set JAX_TOKENWEAVE_MULTIMEM=1"
    if os.environ.get("NCCL_NVLS_ENABLE") == "0":
        return ("NVLink multicast is disabled on this machine (NCCL_NVLS_ENABLE=0), so the "
                "multimem path (JAX_TOKENWEAVE_MULTIMEM=1) refuses to run")
    return None


def area_bytes() -> int:
    """Bytes of one (slot, parity) workspace area: the most one call may use."""
    return (workspace_bytes() // (2 * num_slots())) // 256 * 256


def resolve_algo(algo: Algo, axis_size: int, dtype, shape) -> int:
    """The kernel variant (1 two-shot, 2 one-shot, 3 direct) a call of this shape runs.

    ``"auto"`` runs ``JAX_TOKENWEAVE_ALGO`` where that names a variant, else one-shot for
    messages up to ``JAX_TOKENWEAVE_ONESHOT_BYTES`` and direct above (two-shot where
    :func:`peer_buffer_reason` rules direct out). Direct was the fastest variant at every
    size and CTA count measured from 1024 tokens up (benchmarks/results/2026-11-23-h200x2).
    Asking for direct (here or through ``JAX_TOKENWEAVE_ALGO``) where
    :func:`peer_buffer_reason` rules it out raises ``RuntimeError``.
    """
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {tuple(ALGOS)}, got {algo!r}")
    if algo == "auto":
        algo = env_algo()
    if algo == "direct" and (why := peer_buffer_reason()) is not None:
        raise RuntimeError(f"the fused kernel's algo='direct' cannot run: {why} "
                           "(use algo='two_shot')")
    if algo != "auto":
        return ALGOS[algo]
    tokens, hidden = shape
    es = jnp.dtype(dtype).itemsize
    rows = -(-tokens // axis_size)
    one = (axis_size - 1) * (tokens + rows) * hidden * es
    if tokens * hidden * es <= oneshot_bytes() and one <= area_bytes():
        return ALGOS["one_shot"]
    return ALGOS["two_shot"] if peer_buffer_reason() is not None else ALGOS["direct"]


def peer_buffer_reason() -> str | None:
    """None where XLA's device buffers can be read and written by peers (plain device
    allocations: the default BFC allocator, or "platform"); else why the ``direct`` variant,
    which does so, cannot run: CUDA's stream-ordered pools (``cuda_async``) are not mapped by
    peer access."""
    allocator = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default")
    if allocator == "cuda_async":
        return ("XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async: XLA's buffers come from CUDA memory "
                "pools that peer access does not map, so peers cannot reach them")
    return None


def needed_bytes(axis_size: int, dtype, shape, algo: int = 1) -> int:
    """Bytes of a (slot, parity) area a call needs (algo: 1 two-shot, 2 one-shot, 3 direct)."""
    tokens, hidden = shape
    es = jnp.dtype(dtype).itemsize
    rows = -(-tokens // axis_size)
    if multimem_requested():
        return 2 * axis_size * rows * hidden * es
    if algo == 2:
        return (axis_size - 1) * (tokens + rows) * hidden * es
    if algo == 3:
        return DIRECT_BYTES
    return 2 * (axis_size - 1) * rows * hidden * es


def shape_reason(axis_size: int, dtype, shape, *, num_ctas: int | None = None,
                 slot: int = 0) -> str | None:
    """The part of ``unavailable_reason`` that depends only on sizes (no devices needed)."""
    if axis_size > MAX_RANKS:
        return f"the axis has {axis_size} devices; the fused kernel supports at most {MAX_RANKS}"
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype)} is not supported (bfloat16, float16, float32 are)"
    if len(shape) != 2:
        return f"partial must be [tokens, hidden], got shape {tuple(shape)}"
    tokens, hidden = shape
    if hidden % 8 or hidden > MAX_HIDDEN:
        return (f"hidden size {hidden} is not a multiple of 8 at most {MAX_HIDDEN} "
                "(the kernel moves 16-byte vectors)")
    if num_ctas is not None and not MIN_CTAS <= num_ctas <= MAX_CTAS:
        return f"num_ctas={num_ctas} is outside [{MIN_CTAS}, {MAX_CTAS}]"
    if not 0 <= slot < num_slots():
        return f"slot {slot} is outside [0, {num_slots()}) (JAX_TOKENWEAVE_SLOTS)"
    try:
        algo = resolve_algo("auto", axis_size, dtype, shape)
    except RuntimeError as err:  # JAX_TOKENWEAVE_ALGO=direct where direct cannot run
        return str(err)
    need = needed_bytes(axis_size, dtype, shape, algo)
    if need > area_bytes():
        return (f"[{tokens}, {hidden}] {jnp.dtype(dtype)} over {axis_size} devices needs {need} "
                f"bytes of workspace per slot but a slot holds {area_bytes()} "
                "(raise JAX_TOKENWEAVE_WORKSPACE_MB)")
    return None


def device_groups(mesh: Mesh, axis_name: str) -> list[list[jax.Device]]:
    """The device groups along ``axis_name`` (one per combination of the other mesh axes)."""
    axis = mesh.axis_names.index(axis_name)
    devs = np.moveaxis(mesh.devices, axis, -1)
    return [list(g) for g in devs.reshape(-1, devs.shape[-1])]


@functools.cache
def _peer_reason(ordinals: tuple[int, ...]) -> str | None:
    for a in ordinals:
        for b in ordinals:
            if a != b and not _ext.can_access_peer(a, b):
                return f"CUDA devices {a} and {b} are not peers (no P2P/NVLink access)"
    return None


def unavailable_reason(mesh, axis_name, dtype, shape, *, num_ctas: int | None = None,
                       slot: int = 0) -> str | None:
    """None where ``impl="ffi"`` can run for this mesh axis, dtype and per-rank [T, H] shape;
    otherwise one sentence saying why."""
    if _ext is None:
        return f"the jax-tokenweave CUDA extension is not available ({_IMPORT_ERROR})"
    if mesh is None:
        return "impl='ffi' needs the concrete mesh (pass mesh=...)"
    if axis_name not in mesh.axis_names:
        return f"axis {axis_name!r} is not an axis of the mesh {mesh.axis_names}"
    if jax.process_count() > 1:
        return "the fused kernel needs all devices in one process (jax.process_count() > 1)"
    devices = list(mesh.devices.flat)
    platforms = {d.platform for d in devices}
    if platforms != {"gpu"}:
        return f"the mesh's devices are {sorted(platforms)}, not CUDA GPUs"
    local = set(jax.local_devices())
    if any(d not in local for d in devices):
        return "the mesh holds devices that are not local GPUs of this process"
    if multimem_requested():
        why = multimem_refusal()
        if why is not None:
            return why
    axis_size = mesh.shape[axis_name]
    why = shape_reason(axis_size, dtype, shape, num_ctas=num_ctas, slot=slot)
    if why is not None:
        return why
    for group in device_groups(mesh, axis_name):
        why = _peer_reason(tuple(d.local_hardware_id for d in group))
        if why is not None:
            return why
    return None


def comm_id(mesh: Mesh, axis_name: str) -> int:
    """The comm (symmetric workspace, peer access) for this mesh axis, registered once."""
    groups = device_groups(mesh, axis_name)
    ordinals = tuple(d.local_hardware_id for g in groups for d in g)
    key = (ordinals, len(groups[0]), workspace_bytes(), num_slots(), multimem_requested())
    with _lock:
        if key not in _comms:
            if key[-1] and multimem_refusal() is not None:
                raise RuntimeError(multimem_refusal())
            _comms[key] = _ext.register_comm(list(ordinals), key[1], key[2], key[3], key[4])
        return _comms[key]


def _prepare(partial, residual, weight, axis_name, mesh, num_ctas, slot, algo):
    axis_size = mesh.shape[axis_name] if mesh is not None else 0
    num_ctas = DEFAULT_NUM_CTAS if num_ctas is None else int(num_ctas)
    if not MIN_CTAS <= num_ctas <= MAX_CTAS:
        raise ValueError(f"num_ctas must be in [{MIN_CTAS}, {MAX_CTAS}], got {num_ctas}")
    reason = unavailable_reason(mesh, axis_name, partial.dtype, partial.shape, slot=slot)
    if reason is not None:
        raise RuntimeError(f"the fused allreduce_rmsnorm kernel is unavailable: {reason}")
    register_targets()
    rows = -(-partial.shape[0] // axis_size)
    if residual.shape != (rows, partial.shape[1]):
        raise ValueError(f"residual must be token-sharded {(rows, partial.shape[1])}, "
                         f"got {residual.shape}")
    attrs = dict(comm_id=np.int64(comm_id(mesh, axis_name)), slot=np.int32(slot),
                 num_ctas=np.int32(num_ctas),
                 algo=np.int32(resolve_algo(algo, axis_size, partial.dtype, partial.shape)))
    outs = (jax.ShapeDtypeStruct(partial.shape, partial.dtype),
            jax.ShapeDtypeStruct(residual.shape, residual.dtype))
    return weight.astype(jnp.float32), attrs, outs


def allreduce_rmsnorm(partial: jax.Array, residual: jax.Array, weight: jax.Array, *,
                      axis_name: str, mesh: Mesh, eps: float = 1e-6, num_ctas: int | None = None,
                      slot: int = 0, algo: Algo = "auto") -> tuple[jax.Array, jax.Array]:
    """The fused kernel, inside ``shard_map``: same contract as ``ops.allreduce_rmsnorm``
    (partial [T, H], token-sharded residual [ceil(T/N), H], weight [H]) -> (normed [T, H],
    residual_out). ``algo``: "auto" (by size, or JAX_TOKENWEAVE_ALGO), "two_shot", "one_shot"
    or "direct" (see ffi/README.md)."""
    w32, attrs, outs = _prepare(partial, residual, weight, axis_name, mesh, num_ctas, slot, algo)
    call = jax.ffi.ffi_call(TARGETS["allreduce_rmsnorm"], outs)
    return call(partial, residual, w32, eps=np.float32(eps), **attrs)


class Pending(NamedTuple):
    """What ``allreduce_rmsnorm_start`` hands to ``allreduce_rmsnorm_done`` (a pytree): the
    not-yet-valid outputs and every buffer the side stream still reads."""

    normed: jax.Array
    residual_out: jax.Array
    partial: jax.Array
    residual: jax.Array
    weight: jax.Array  # float32, the very buffer the kernel reads


def allreduce_rmsnorm_start(partial: jax.Array, residual: jax.Array, weight: jax.Array, *,
                            axis_name: str, mesh: Mesh, eps: float = 1e-6,
                            num_ctas: int | None = None, slot: int = 0,
                            algo: Algo = "auto") -> Pending:
    """Starts the fused kernel on the device's high-priority side stream, after everything XLA
    queued before it, and returns a ``Pending`` whose outputs are NOT valid yet.

    Ordering requirements: read the outputs only through ``allreduce_rmsnorm_done(pending)``;
    do not modify or donate anything in ``pending``; at most one start per slot may be
    outstanding (``done`` before the next ``start`` on that slot); calls in flight together use
    different slots. XLA orders by data only: to overlap compute with the kernel, pass the
    compute's input through ``jax.lax.optimization_barrier`` together with ``pending`` (so it
    runs after ``start``), and pass ``pending`` and the compute's output through another
    ``optimization_barrier`` before ``done`` (so ``done`` waits after it)."""
    w32, attrs, outs = _prepare(partial, residual, weight, axis_name, mesh, num_ctas, slot, algo)
    call = jax.ffi.ffi_call(TARGETS["allreduce_rmsnorm_start"], outs)
    normed, residual_out = call(partial, residual, w32, eps=np.float32(eps), **attrs)
    return Pending(normed, residual_out, partial, residual, w32)


def allreduce_rmsnorm_done(pending: Pending, *, axis_name: str, mesh: Mesh,
                           slot: int = 0) -> tuple[jax.Array, jax.Array]:
    """Makes XLA's stream wait for the kernel ``allreduce_rmsnorm_start`` began on ``slot`` and
    returns its ``(normed, residual_out)`` (aliased to the pending buffers). The start's
    operands are passed along so XLA keeps them alive until here."""
    outs = (jax.ShapeDtypeStruct(pending.normed.shape, pending.normed.dtype),
            jax.ShapeDtypeStruct(pending.residual_out.shape, pending.residual_out.dtype))
    call = jax.ffi.ffi_call(TARGETS["allreduce_rmsnorm_done"], outs,
                            input_output_aliases={0: 0, 1: 1})
    return call(*pending, comm_id=np.int64(comm_id(mesh, axis_name)), slot=np.int32(slot))
