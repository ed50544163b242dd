"""The fused kernel's communicator: one object per mesh axis that owns the symmetric workspace
(settings: :mod:`jax_tokenweave.kernel.comm_settings`). It says why the kernel cannot run for a
call (:meth:`Communicator.unavailable_reason`), picks the variant and CTAs
(:meth:`Communicator.choose`) and registers the workspace on first use; its sync state lives on
the GPUs, so XLA can capture the calls in command buffers. A wait past ``timeout_s`` fails it
for good (:class:`CommFailed`; replays give NaN); :func:`reset_communicators` starts over.
Details: docs/KERNEL.md#kernelcomm."""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from jax.typing import DTypeLike

from jax_tokenweave.kernel import _extension, comm_ipc
from jax_tokenweave.kernel import policy as kernel_policy
from jax_tokenweave.kernel.comm_settings import ALGOS as ALGOS  # re-exported: settings, checks
from jax_tokenweave.kernel.comm_settings import DTYPES as DTYPES
from jax_tokenweave.kernel.comm_settings import CommSettings as CommSettings
from jax_tokenweave.kernel.comm_settings import choose as choose
from jax_tokenweave.kernel.comm_settings import direct_reason as direct_reason
from jax_tokenweave.kernel.comm_settings import multimem_refusal as multimem_refusal
from jax_tokenweave.kernel.comm_settings import peer_buffer_reason as peer_buffer_reason
from jax_tokenweave.kernel.comm_settings import shape_reason as shape_reason
from jax_tokenweave.kernel.policy import KernelPolicy


class CommFailed(RuntimeError):
    """A fused kernel's cross-GPU wait expired; the communicator cannot be used any more."""


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
        self,
        dtype: DTypeLike,
        shape: Sequence[int],
        *,
        num_ctas: int | None = None,
        slot: int = 0,
        algo: str = "auto",
        residual_replicated: bool = False,
    ) -> str | None:
        """None where a call of per-rank ``shape`` [T, H] can run; else one sentence why.
        ``residual_replicated``: [T, H] on every rank, no residual rows travel."""
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
            residual_replicated=residual_replicated,
        )

    def choose(
        self,
        dtype: DTypeLike,
        shape: Sequence[int],
        *,
        algo: str = "auto",
        num_ctas: int | None = None,
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
                    ce_bytes=s.ce_bytes,
                    launch_gate=s.launch_gate,
                )
                if self.cross_process:
                    try:
                        comm_ipc.connect(ext, comm_id, groups, me, self._exchange, s.timeout_s)
                    except BaseException:
                        ext.release_comm(comm_id)
                        raise
                self._id = comm_id
            return self._id

    def identity(self) -> str:
        """What this communicator connects: the mesh's axes and device ids, the axis, the
        settings, this process's index. A compiled call of the fused kernel names its
        communicator by :attr:`comm_id`, which counts up from 1 in each process:
        ``serving.compilation.executable_cache`` keys stored programs by id and identity, so a later
        process loads them only where the same id names the same communicator."""
        devices = [d.id for d in self.mesh.devices.flat]
        return repr(
            (self.mesh.axis_names, devices, self.axis_name, self.settings, jax.process_index())
        )

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
        """Kernel launches the FFI handlers issued, over all of the comm's GPUs (one per GPU
        per call; a command-buffer replay issues none)."""
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
