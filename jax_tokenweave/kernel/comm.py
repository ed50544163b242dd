"""The fused kernel's communicator: one object per mesh axis that owns the symmetric workspace.

A :class:`Communicator` holds the settings (:class:`CommSettings`), says in one sentence why
the fused kernel cannot run for a given call (:meth:`Communicator.unavailable_reason`), picks
the kernel variant and CTA count (:meth:`Communicator.choose`, from the shipped
:mod:`jax_tokenweave.kernel.policy` table), and registers the workspace with the extension on
first use. Its sync state lives on the GPUs and is advanced by the kernels, so XLA can capture
the calls in command buffers. A cross-GPU wait that exceeds ``timeout_s`` makes the
communicator fail for good: later calls raise (or, replayed from a command buffer, produce NaN)
and :meth:`Communicator.check` raises :class:`CommFailed`; :func:`reset_communicators` (in
every process) frees the shared ones and clears JAX's caches, so the next traced call builds
new ones.

Settings are constructor arguments; environment variables only give their defaults:

==================================  =========================================================
``JAX_TOKENWEAVE_WORKSPACE_MB``     data area per device (2048): slots x 2 parities of the
                                    two-shot staging area (direct needs 16 bytes of it)
``JAX_TOKENWEAVE_ONESHOT_MB``       one one-shot receive buffer (8); 3 per slot
``JAX_TOKENWEAVE_SLOTS``            independent slots (4); calls in flight together need
                                    different slots
``JAX_TOKENWEAVE_TIMEOUT_S``        bound on every cross-GPU wait (30)
``JAX_TOKENWEAVE_ALGO``             ``auto`` (by the policy table), ``one_shot``, ``two_shot``
                                    or ``direct``
``JAX_TOKENWEAVE_MULTIMEM=1``       opt into NVLink multicast; refused where
                                    ``NCCL_NVLS_ENABLE=0``
==================================  =========================================================
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_tokenweave.kernel import _extension, comm_ipc
from jax_tokenweave.kernel import policy as kernel_policy
from jax_tokenweave.kernel.policy import KernelPolicy

ALGOS = ("auto", *kernel_policy.ALGOS)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


class CommFailed(RuntimeError):
    """A fused kernel's cross-GPU wait expired; the communicator cannot be used any more."""


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


@dataclasses.dataclass(frozen=True)
class CommSettings:
    """How a communicator is built. ``from_env`` fills unset fields from the environment."""

    workspace_mib: float = 2048.0
    oneshot_mib: float = 8.0
    num_slots: int = 4
    timeout_s: float = 30.0
    algo: str = "auto"
    multimem: bool = False

    def __post_init__(self) -> None:
        if not self.workspace_mib > 0 or not self.oneshot_mib >= 0:
            raise ValueError(
                f"workspace_mib must be > 0 and oneshot_mib >= 0, got "
                f"{self.workspace_mib}, {self.oneshot_mib}"
            )
        if not isinstance(self.num_slots, int) or self.num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {self.num_slots!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, got {self.algo!r}")

    @classmethod
    def from_env(cls, **overrides) -> CommSettings:
        """Settings with the ``JAX_TOKENWEAVE_*`` environment as defaults, ``overrides`` on top
        (None values ignored)."""
        fields: dict[str, Any] = dict(
            workspace_mib=float(_env("JAX_TOKENWEAVE_WORKSPACE_MB", "2048")),
            oneshot_mib=float(_env("JAX_TOKENWEAVE_ONESHOT_MB", "8")),
            num_slots=int(_env("JAX_TOKENWEAVE_SLOTS", "4")),
            timeout_s=float(_env("JAX_TOKENWEAVE_TIMEOUT_S", "30")),
            algo=_env("JAX_TOKENWEAVE_ALGO", "auto"),
            multimem=_env("JAX_TOKENWEAVE_MULTIMEM", "0") == "1",
        )
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    @property
    def area_bytes(self) -> int:
        """One parity of a slot's data area (what a two-shot call may use)."""
        return int(self.workspace_mib * 2**20) // (2 * self.num_slots) // 256 * 256

    @property
    def oneshot_bytes(self) -> int:
        """One one-shot receive buffer (what a one-shot call may use)."""
        return int(self.oneshot_mib * 2**20) // 256 * 256


def multimem_refusal(settings: CommSettings) -> str | None:
    """None where the multimem path may run; else why not (checked before any multicast call)."""
    if not settings.multimem:
        return "the multimem path is opt-in: set JAX_TOKENWEAVE_MULTIMEM=1 (or multimem=True)"
    if os.environ.get("NCCL_NVLS_ENABLE") == "0":
        return (
            "NVLink multicast is disabled on this machine (NCCL_NVLS_ENABLE=0), so the "
            "multimem path refuses to run"
        )
    return None


def peer_buffer_reason() -> str | None:
    """None where XLA's device buffers can be read and written by peers (plain device
    allocations: the default BFC allocator, or "platform"); else why the ``direct`` variant,
    which does so, cannot run: CUDA's stream-ordered pools (``cuda_async``) are not mapped by
    peer access."""
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default") == "cuda_async":
        return (
            "XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async: XLA's buffers come from CUDA memory "
            "pools that peer access does not map, so peers cannot reach them"
        )
    return None


def direct_reason(cross_process: bool = False) -> str | None:
    """None where the ``direct`` variant (which reads and writes XLA's buffers by address) can
    run; else why not."""
    if cross_process:
        return "the axis spans processes, and XLA's buffers of another process cannot be mapped"
    return peer_buffer_reason()


def choose(
    axis_size: int,
    dtype,
    shape,
    settings: CommSettings,
    *,
    algo: str = "auto",
    num_ctas: int | None = None,
    policy: KernelPolicy | None = None,
    cross_process: bool = False,
) -> tuple[str, int]:
    """The ``(algo, num_ctas)`` a call of per-rank ``shape`` [T, H] runs: ``algo`` if not
    "auto", else ``settings.algo`` if not "auto", else the policy table's by message size
    (``direct`` becomes ``two_shot`` where :func:`direct_reason` rules it out). An explicit
    ``direct`` that cannot run raises RuntimeError. ``num_ctas`` None: the table's (capped at
    the variant's limit where the table names another variant)."""
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if algo == "auto":
        algo = settings.algo
    row = (policy or kernel_policy.load()).choose(
        axis_size, int(np.prod(shape)) * jnp.dtype(dtype).itemsize
    )
    if algo == "direct" and (why := direct_reason(cross_process)) is not None:
        raise RuntimeError(
            f"the fused kernel's algo='direct' cannot run: {why} (use algo='two_shot')"
        )
    if algo == "auto":
        algo = row.algo
        if algo == "direct" and direct_reason(cross_process) is not None:
            algo = "two_shot"
    if num_ctas is not None:
        return algo, int(num_ctas)
    ctas = row.num_ctas  # the table's row may be another variant's, with more CTAs than this one
    if algo != "one_shot" and _extension.import_error() is None:
        ctas = min(ctas, _extension.limits()["max_ctas"])
    return algo, ctas


def shape_reason(
    axis_size: int,
    dtype,
    shape,
    settings: CommSettings,
    *,
    num_ctas: int | None = None,
    slot: int = 0,
    algo: str = "auto",
    policy: KernelPolicy | None = None,
    cross_process: bool = False,
) -> str | None:
    """The part of :meth:`Communicator.unavailable_reason` that depends only on sizes and
    settings (no devices needed); limits and byte counts come from the extension."""
    lim = _extension.limits()
    if axis_size > lim["max_ranks"]:
        return (
            f"the axis has {axis_size} devices; the fused kernel supports at most "
            f"{lim['max_ranks']}"
        )
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype)} is not supported (bfloat16, float16, float32 are)"
    if len(shape) != 2:
        return f"partial must be [tokens, hidden], got shape {tuple(shape)}"
    tokens, hidden = shape
    if hidden % lim["hidden_multiple"] or hidden > lim["max_hidden"]:
        return (
            f"hidden size {hidden} is not a multiple of {lim['hidden_multiple']} at most "
            f"{lim['max_hidden']} (the kernel moves 16-byte vectors)"
        )
    if not 0 <= slot < settings.num_slots:
        return f"slot {slot} is outside [0, {settings.num_slots}) (num_slots)"
    if settings.multimem and (why := multimem_refusal(settings)) is not None:
        return why
    try:
        algo, _ = choose(
            axis_size, dtype, shape, settings, algo=algo, policy=policy, cross_process=cross_process
        )
    except RuntimeError as err:  # an explicit direct where direct cannot run
        return str(err)
    top = lim["max_oneshot_ctas"] if algo == "one_shot" else lim["max_ctas"]
    if num_ctas is not None and not lim["min_ctas"] <= num_ctas <= top:
        return f"num_ctas={num_ctas} is outside [{lim['min_ctas']}, {top}] for algo={algo}"
    need = _extension.get().needed_bytes(
        algo, axis_size, tokens, hidden, jnp.dtype(dtype).itemsize, settings.multimem
    )
    have, what = (
        (settings.oneshot_bytes, "one-shot buffer (oneshot_mib)")
        if algo == "one_shot" and not settings.multimem
        else (settings.area_bytes, "data area (workspace_mib)")
    )
    if need > have:
        return (
            f"[{tokens}, {hidden}] {jnp.dtype(dtype)} over {axis_size} devices with "
            f"algo={algo} needs {need} bytes of {what} per slot but the communicator has "
            f"{have}"
        )
    return None


def device_groups(mesh: Mesh, axis_name: str) -> list[list[jax.Device]]:
    """The device groups along ``axis_name`` (one per combination of the other mesh axes)."""
    axis = mesh.axis_names.index(axis_name)
    devs = np.moveaxis(mesh.devices, axis, -1)
    return [list(g) for g in devs.reshape(-1, devs.shape[-1])]


@functools.cache
def _peer_reason(ordinals: tuple[int, ...]) -> str | None:
    ext = _extension.get()
    for a in ordinals:
        for b in ordinals:
            if a != b and not ext.can_access_peer(a, b):
                return f"CUDA devices {a} and {b} are not peers (no P2P/NVLink access)"
    return None


def device_reason(mesh: Mesh, axis_name: str) -> str | None:
    """None where the fused kernel can run over this mesh axis's devices; else why not."""
    if _extension.import_error() is not None:
        return f"the jax-tokenweave CUDA extension is not available ({_extension.import_error()})"
    if axis_name not in mesh.axis_names:
        return f"axis {axis_name!r} is not an axis of the mesh {mesh.axis_names}"
    platforms = {d.platform for d in mesh.devices.flat}
    if platforms != {"gpu"}:
        return f"the mesh's devices are {sorted(platforms)}, not CUDA GPUs"
    if jax.process_count() > 1:  # one process per GPU: the hosts are checked on connecting
        return comm_ipc.layout_reason(device_groups(mesh, axis_name), jax.process_index())
    local = set(jax.local_devices())
    if any(d not in local for d in mesh.devices.flat):
        return "the mesh holds devices that are not local GPUs of this process"
    for group in device_groups(mesh, axis_name):
        if (why := _peer_reason(tuple(d.local_hardware_id for d in group))) is not None:
            return why
    return None


class Communicator:
    """The fused kernel's communicator for ``mesh``'s axis ``axis_name`` (see the module
    docstring). Cheap to build; the workspace is allocated at the first :attr:`comm_id`."""

    def __init__(
        self,
        mesh: Mesh,
        axis_name: str = "tp",
        settings: CommSettings | None = None,
        *,
        policy: KernelPolicy | None = None,
    ):
        self.mesh, self.axis_name = mesh, axis_name
        self.settings = settings or CommSettings.from_env()
        self.policy = policy or kernel_policy.load()
        self._device_reason = device_reason(mesh, axis_name)
        self.axis_size = mesh.shape[axis_name] if axis_name in mesh.axis_names else 0
        self._id: int | None = None
        self._lock = threading.Lock()
        self.cross_process = False  # some group holds devices of other processes
        if jax.process_count() > 1 and self._device_reason is None:
            # A collective step: every process builds this communicator, in the same order.
            self._exchange = comm_ipc.Exchange()
            groups, me = device_groups(mesh, axis_name), jax.process_index()
            info = comm_ipc.publish_and_gather(
                self._exchange,
                groups,
                me,
                {d.id: d.local_hardware_id for d in jax.local_devices()},
                self.settings.timeout_s,
            )
            self._device_reason = comm_ipc.host_reason(
                groups, me, info, _extension.get().can_access_peer
            )
            self.cross_process = self._device_reason is None and bool(
                comm_ipc.peers_elsewhere(groups, me)
            )

    def unavailable_reason(
        self, dtype, shape, *, num_ctas: int | None = None, slot: int = 0, algo: str = "auto"
    ) -> str | None:
        """None where a call of per-rank ``shape`` [T, H] can run; else one sentence why."""
        if self._device_reason is not None:
            return self._device_reason
        return shape_reason(
            self.axis_size,
            dtype,
            shape,
            self.settings,
            num_ctas=num_ctas,
            slot=slot,
            algo=algo,
            policy=self.policy,
            cross_process=self.cross_process,
        )

    def choose(
        self, dtype, shape, *, algo: str = "auto", num_ctas: int | None = None
    ) -> tuple[str, int]:
        """``(algo, num_ctas)`` for a call (see :func:`choose`)."""
        return choose(
            self.axis_size,
            dtype,
            shape,
            self.settings,
            algo=algo,
            num_ctas=num_ctas,
            policy=self.policy,
            cross_process=self.cross_process,
        )

    @property
    def comm_id(self) -> int:
        """The extension's id of this communicator's workspace, allocated on first use."""
        with self._lock:
            if self._id is None:
                if self._device_reason is not None:
                    raise RuntimeError(f"the fused kernel is unavailable: {self._device_reason}")
                if self.settings.multimem and (why := multimem_refusal(self.settings)):
                    raise RuntimeError(why)
                groups = device_groups(self.mesh, self.axis_name)
                s, ext, me = self.settings, _extension.get(), jax.process_index()
                comm_id = ext.register_comm(
                    [
                        d.local_hardware_id if d.process_index == me else -1
                        for g in groups
                        for d in g
                    ],
                    len(groups[0]),
                    s.area_bytes,
                    s.oneshot_bytes,
                    s.num_slots,
                    s.timeout_s,
                    s.multimem,
                )
                if self.cross_process:
                    try:
                        comm_ipc.connect(ext, comm_id, groups, me, self._exchange, s.timeout_s)
                    except BaseException:
                        ext.release_comm(comm_id)
                        raise
                self._id = comm_id
            return self._id

    def close(self) -> None:
        """Retires the workspace (after its GPUs finish): launches with it are refused, a
        command-buffer replay of a call compiled with it aborts and writes NaN, and its large
        buffers are freed unless other processes map them. Using :attr:`comm_id` again
        allocates a new one."""
        with self._lock:
            if self._id is not None:
                _extension.get().release_comm(self._id)
                self._id = None

    def failure(self) -> str | None:
        """Why this communicator failed (a wait expired), or None."""
        return None if self._id is None else _extension.get().failure_message(self._id)

    def check(self) -> None:
        """Raises :class:`CommFailed` if a wait expired: the way to learn of a failure from
        calls replayed in a command buffer, which run no host code (their outputs are NaN)."""
        if (why := self.failure()) is not None:
            raise CommFailed(why)

    def launches(self) -> int:
        """Kernel launches the FFI handlers issued (a command-buffer replay issues none)."""
        return 0 if self._id is None else _extension.get().launches(self._id)


_cache: dict[tuple, Communicator] = {}
_cache_lock = threading.Lock()


def get_communicator(mesh: Mesh, axis_name: str = "tp") -> Communicator:
    """The shared communicator for ``mesh``'s ``axis_name`` with the environment's settings
    (one per distinct settings, created once)."""
    key = (mesh, axis_name, CommSettings.from_env())
    with _cache_lock:
        if key not in _cache:
            _cache[key] = Communicator(mesh, axis_name, key[2])
        return _cache[key]


def reset_communicators() -> int:
    """Closes and forgets every shared communicator (:func:`get_communicator`) and clears JAX's
    compilation caches, so the next traced call builds fresh ones: the way back after
    :class:`CommFailed`. With one process per GPU, every process must call it. Returns how
    many were dropped."""
    with _cache_lock:
        dropped = list(_cache.values())
        _cache.clear()
    for c in dropped:
        c.close()
    jax.clear_caches()
    return len(dropped)
