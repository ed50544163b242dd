"""The fused kernel's settings and what follows from them and a call's sizes alone (no devices):
:class:`CommSettings` (constructor arguments; ``JAX_TOKENWEAVE_*`` environment variables give
their defaults), the kernel variant and CTA count of a call (:func:`choose`, from the
:mod:`jax_tokenweave.kernel.policy` table) and why a per-rank shape [T, H] cannot run
(:func:`shape_reason`). The variables: docs/KERNEL.md#kernelcomm_settings."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jax_tokenweave.kernel import _extension
from jax_tokenweave.kernel import policy as kernel_policy
from jax_tokenweave.kernel.policy import KernelPolicy

ALGOS = ("auto", *kernel_policy.ALGOS)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


@dataclasses.dataclass(frozen=True)
class CommSettings:
    """How a communicator is built. ``from_env`` fills unset fields from the environment."""

    workspace_mib: float = 2048.0
    oneshot_mib: float = 8.0
    ce_mib: float = 1024.0
    num_slots: int = 4
    timeout_s: float = 30.0
    algo: str = "auto"
    multimem: bool = False
    launch_gate: bool = True  # one process, several GPUs: calls wait for every local device

    def __post_init__(self) -> None:
        if not self.workspace_mib > 0 or not self.oneshot_mib >= 0 or not self.ce_mib >= 0:
            raise ValueError(
                f"workspace_mib must be > 0, oneshot_mib and ce_mib >= 0, got "
                f"{self.workspace_mib}, {self.oneshot_mib}, {self.ce_mib}"
            )
        if not isinstance(self.num_slots, int) or self.num_slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {self.num_slots!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, got {self.algo!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> CommSettings:
        """Settings with the ``JAX_TOKENWEAVE_*`` environment as defaults, ``overrides`` on top
        (None values ignored)."""
        fields: dict[str, Any] = dict(
            workspace_mib=float(_env("JAX_TOKENWEAVE_WORKSPACE_MB", "2048")),
            oneshot_mib=float(_env("JAX_TOKENWEAVE_ONESHOT_MB", "8")),
            ce_mib=float(_env("JAX_TOKENWEAVE_CE_MB", "1024")),
            num_slots=int(_env("JAX_TOKENWEAVE_SLOTS", "4")),
            timeout_s=float(_env("JAX_TOKENWEAVE_TIMEOUT_S", "30")),
            algo=_env("JAX_TOKENWEAVE_ALGO", "auto"),
            multimem=_env("JAX_TOKENWEAVE_MULTIMEM", "0") == "1",
            launch_gate=_env("JAX_TOKENWEAVE_LAUNCH_GATE", "1") != "0",
        )
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    @property
    def area_bytes(self) -> int:
        """One parity of a slot's data area (what a two-shot call may use)."""
        return int(self.workspace_mib * 2**20) // (2 * self.num_slots) // 256 * 256

    @property
    def ce_bytes(self) -> int:
        """One slot's copy-engine staging area (what a ``ce`` call may use): ``ce_mib`` over
        the slots."""
        return int(self.ce_mib * 2**20) // self.num_slots // 256 * 256

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
    dtype: DTypeLike,
    shape: Sequence[int],
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
        ctas = min(ctas, max_ctas(algo))
    return algo, ctas


def max_ctas(algo: str) -> int:
    """The largest CTA count of a variant (the extension's limits)."""
    lim = _extension.limits()
    if algo == "one_shot":
        return lim["max_oneshot_ctas"]
    return lim.get("max_ce_ctas", lim["max_ctas"]) if algo == "ce" else lim["max_ctas"]


def shape_reason(
    axis_size: int,
    dtype: DTypeLike,
    shape: Sequence[int],
    settings: CommSettings,
    *,
    num_ctas: int | None = None,
    slot: int = 0,
    algo: str = "auto",
    policy: KernelPolicy | None = None,
    cross_process: bool = False,
    residual_replicated: bool = False,
) -> str | None:
    """The part of :meth:`~jax_tokenweave.kernel.comm.Communicator.unavailable_reason` that
    depends only on sizes and settings (no devices needed); limits and byte counts come from
    the extension. ``residual_replicated``: no residual rows travel (fewer one-shot bytes)."""
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
    if algo == "ce" and settings.multimem:
        return "the copy-engine variant (algo='ce') runs on communicators without multimem"
    if algo == "ce" and residual_replicated:
        return "a replicated residual needs the decode one-shot kernel, not algo='ce'"
    top = max_ctas(algo)
    if num_ctas is not None and not lim["min_ctas"] <= num_ctas <= top:
        return f"num_ctas={num_ctas} is outside [{lim['min_ctas']}, {top}] for algo={algo}"
    need = _extension.get().needed_bytes(
        algo,
        axis_size,
        tokens,
        hidden,
        jnp.dtype(dtype).itemsize,
        settings.multimem,
        residual_replicated and algo == "one_shot",
    )
    if algo == "one_shot" and not settings.multimem:
        have, what = settings.oneshot_bytes, "one-shot buffer (oneshot_mib)"
    elif algo == "ce":
        have, what = settings.ce_bytes, "copy-engine staging area (ce_mib)"
    else:
        have, what = settings.area_bytes, "data area (workspace_mib)"
    if need > have:
        return (
            f"[{tokens}, {hidden}] {jnp.dtype(dtype)} over {axis_size} devices with "
            f"algo={algo} needs {need} bytes of {what} per slot but the communicator has "
            f"{have}"
        )
    return None
