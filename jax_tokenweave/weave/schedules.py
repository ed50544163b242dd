"""The schedules of ``WeaveDecoder``: names, argument checks, and their configuration of the
one layer loop (:mod:`jax_tokenweave.nn.stack`): which halves, which reducer.

``schedule``: ``baseline`` (psum, replicated residual), ``weave`` (the plan's halves, token-sharded
residual) or ``nocomm`` (a timing floor, NOT the model's output). ``collective`` (for ``weave``):
``xla``, ``ffi``, ``auto`` (``ffi`` where :func:`unavailable_reason` is None), and the ablations
``ffi-sync`` (token-sharded), ``ffi-replicated`` and ``local``. ``ffi`` on a whole decode-size batch
runs as ``ffi-replicated`` (:func:`resolve_collective`). See docs/WEAVE.md#weaveschedules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, get_args

import jax.numpy as jnp
from jax.sharding import Mesh

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.weave import reducers
from jax_tokenweave.weave import tuning as tuning_lib
from jax_tokenweave.weave.plan import BatchPlan, Half
from jax_tokenweave.weave.tuning import DEFAULT_ENTRY, TuneEntry

Schedule = Literal["baseline", "weave", "nocomm"]
Collective = Literal["auto", "xla", "ffi", "ffi-sync", "ffi-replicated", "local"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
COLLECTIVES: tuple[str, ...] = ("auto", "xla", "ffi")
"""The collectives that compute the model with the overlap where it can (serving, the main
job)."""
ALL_COLLECTIVES: tuple[str, ...] = get_args(Collective)
"""``COLLECTIVES`` plus the ablations ``ffi-sync``, ``ffi-replicated`` and ``local``."""


ReducerFactory = Callable[[reducers.ReduceContext], reducers.Reducer]


def check_call(
    config: DecoderConfig,
    dtype: jnp.dtype,
    tp: int,
    hidden: Any,
    batch: Any,
    schedule: str,
    collective: str,
) -> None:
    """Validate ``WeaveDecoder.__call__``'s arguments; raise ``ValueError`` saying what is wrong."""
    config.check_tensor_parallel(tp)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if collective not in ALL_COLLECTIVES:
        raise ValueError(f"collective must be one of {ALL_COLLECTIVES}, got {collective!r}")
    if not isinstance(batch, BatchPlan):
        raise ValueError(f"batch must be a BatchPlan (see plan_batch), got {type(batch)}")
    shape = tuple(getattr(hidden, "shape", ()))
    if len(shape) != 2:
        raise ValueError(f"hidden must be [tokens, hidden_size], got shape {shape}")
    if shape[0] < 1:
        raise ValueError("hidden has no tokens (empty batch)")
    if shape[1] != config.hidden_size:
        raise ValueError(
            f"hidden has width {shape[1]}, the config's hidden_size is {config.hidden_size}"
        )
    if shape[0] != batch.num_tokens:
        raise ValueError(
            f"hidden has {shape[0]} tokens but the batch's request lengths sum to "
            f"{batch.num_tokens}"
        )
    if not jnp.issubdtype(hidden.dtype, jnp.floating):
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
    if jnp.dtype(hidden.dtype) != jnp.dtype(dtype):
        raise ValueError(f"hidden dtype {hidden.dtype} differs from the model dtype {dtype}")


def unavailable_reason(
    mesh: Mesh,
    axis_name: str,
    dtype: Any,
    batch: BatchPlan,
    hidden_size: int,
    tuning: TuneEntry | None = None,
) -> str | None:
    """Why the fused kernel cannot run this batch's weave schedule (None where it can): the
    kernel's ``unavailable_reason`` for the first half whose ``[T_half, H]`` call (its slot =
    half index, the tuned CTA counts) it refuses."""
    from jax_tokenweave.kernel import _ffi

    entry = DEFAULT_ENTRY if tuning is None else tuning
    for j, half in enumerate(batch.halves):
        for ctas in dict.fromkeys((entry.ctas(j == 0), entry.ctas(False))):
            why = _ffi.unavailable_reason(
                mesh, axis_name, jnp.dtype(dtype), (half.length, hidden_size), num_ctas=ctas, slot=j
            )
            if why is not None:
                return f"half {j} ([{half.length}, {hidden_size}]): {why}"
    return None


def resolve_schedule(schedule: str, collective: str, mesh: Mesh, axis_name: str) -> str:
    """The schedule a call runs: ``weave`` with ``collective="auto"`` on a one-device axis runs
    as
    ``baseline`` (no split, XLA's add + RMSNorm): there is nothing to communicate, so nothing to
    hide, and the split's half-size GEMMs only cost. Measured on one H200 (Llama-3-8B shapes,
    decode batch 64): 7.8 ms per engine step against 8.8 ms for ``weave`` with the one-rank
    fused call, whose per-call dispatch XLA's fusions undercut. An explicit ``collective``
    keeps ``weave`` (benchmarks force ``ffi`` at TP 1 to time the kernel)."""
    if schedule == "weave" and collective == "auto" and mesh.shape.get(axis_name, 0) == 1:
        return "baseline"
    return schedule


def resolve_collective(
    collective: str,
    mesh: Mesh,
    axis_name: str,
    dtype: Any,
    batch: BatchPlan,
    hidden_size: int,
    tuning: TuneEntry | None = None,
) -> str:
    """The weave schedule's collective for this call: ``xla``, ``ffi``, ``ffi-sync``,
    ``ffi-replicated`` or ``local``. ``auto`` is ``ffi`` where :func:`unavailable_reason` gives no
    reason, else ``xla``. ``ffi`` (and ``auto``) on a whole batch is ``ffi-replicated`` where
    :func:`replicated_fits`. An asked ``ffi*`` raises ``RuntimeError`` saying why where the
    kernel cannot run it."""
    if collective not in ALL_COLLECTIVES:
        raise ValueError(f"collective must be one of {ALL_COLLECTIVES}, got {collective!r}")
    if collective in ("xla", "local"):
        return collective
    why = unavailable_reason(mesh, axis_name, dtype, batch, hidden_size, tuning)
    if why is None and collective == "ffi-replicated":
        why = replicated_reason(mesh, axis_name, dtype, batch, hidden_size)
    if why is None:
        if collective in ("auto", "ffi") and replicated_fits(
            mesh, axis_name, dtype, batch, hidden_size
        ):
            return "ffi-replicated"
        return "ffi" if collective == "auto" else collective
    if collective == "auto":
        return "xla"
    raise RuntimeError(
        f"collective={collective!r} is unavailable: {why} (use collective='auto' or 'xla')"
    )


def replicated_reason(
    mesh: Mesh, axis_name: str, dtype: Any, batch: BatchPlan, hidden_size: int
) -> str | None:
    """Why the fused kernel cannot run this batch with a replicated residual (None where it
    can): the batch must be whole (one half) and its ``[T, H]`` call must fit the decode
    one-shot kernel (``_ffi.replicated_reason``)."""
    from jax_tokenweave.kernel import _ffi

    if batch.is_split:
        return "a replicated residual needs a whole batch, this one is split in two halves"
    shape = (batch.num_tokens, hidden_size)
    return _ffi.replicated_reason(mesh, axis_name, jnp.dtype(dtype), shape)


def replicated_fits(
    mesh: Mesh, axis_name: str, dtype: Any, batch: BatchPlan, hidden_size: int
) -> bool:
    """Whether ``ffi`` runs this batch as ``ffi-replicated``: the batch is whole, the kernel
    policy picks one-shot for its token-sharded call (so the replicated call is the same kernel
    moving fewer bytes) and :func:`replicated_reason` gives no reason."""
    from jax_tokenweave.kernel.comm import get_communicator

    if replicated_reason(mesh, axis_name, dtype, batch, hidden_size) is not None:
        return False
    comm = get_communicator(mesh, axis_name)
    algo, _ = comm.choose(jnp.dtype(dtype), (batch.num_tokens, hidden_size))
    return algo == "one_shot"


def configure(
    schedule: str, collective: str, batch: BatchPlan
) -> tuple[tuple[Half, ...], ReducerFactory]:
    """The halves and the reducer factory of ``schedule`` with a *resolved* ``collective``
    (:func:`resolve_collective`; ignored by ``baseline`` and ``nocomm``)."""
    if schedule in ("baseline", "nocomm"):
        whole = batch if not batch.is_split else _unsplit(batch)
        return whole.halves, reducers.Psum if schedule == "baseline" else reducers.Local
    if schedule != "weave":
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    factories: dict[str, ReducerFactory] = {
        "xla": reducers.sharded("xla_rsag"),
        "ffi": reducers.Overlap if batch.is_split else reducers.sharded("ffi"),
        "ffi-sync": reducers.sharded("ffi"),
        "ffi-replicated": reducers.Replicated,
        "local": reducers.LocalSharded,
    }
    if collective == "ffi-replicated" and batch.is_split:
        raise ValueError("collective 'ffi-replicated' needs a whole batch, this one is split")
    if collective not in factories:
        raise ValueError(
            f"collective must be resolved to one of {tuple(factories)}, got {collective!r}"
        )
    return batch.halves, factories[collective]


def _unsplit(batch: BatchPlan) -> BatchPlan:
    from jax_tokenweave.weave.plan import plan_batch

    return plan_batch(batch.request_lengths, split=False)


@dataclasses.dataclass(frozen=True)
class StackSetup:
    """What one call of the decoder stack runs: its ``halves``, its ``reducer`` factory and the
    fused kernel's CTA counts (``tuning``)."""

    halves: tuple[Half, ...]
    reducer: ReducerFactory
    tuning: TuneEntry


def stack_setup(
    config: DecoderConfig,
    mesh: Mesh,
    axis_name: str,
    dtype: Any,
    batch: BatchPlan,
    *,
    schedule: str,
    collective: str = "auto",
    tuning: TuneEntry | None = None,
    reducer: ReducerFactory | None = None,
) -> StackSetup:
    """The one setup of ``WeaveDecoder`` and the serving step for ``batch`` on ``mesh``'s
    ``axis_name``: the CTA counts (``tuning``, else the plan's, else the tuning table's entry
    for the model, TP degree and token count), the schedule (:func:`resolve_schedule`), the
    collective (:func:`resolve_collective`; ``xla`` where ``reducer`` replaces the schedule's)
    and :func:`configure`'s halves and reducer."""
    tp = mesh.shape[axis_name]
    entry = (
        tuning
        or batch.tuning
        or tuning_lib.lookup(tuning_lib.model_name(config), tp, batch.num_tokens)
    )
    if reducer is None:
        schedule = resolve_schedule(schedule, collective, mesh, axis_name)
    resolved = (
        resolve_collective(collective, mesh, axis_name, dtype, batch, config.hidden_size, entry)
        if schedule == "weave" and reducer is None
        else "xla"
    )
    halves, factory = configure(schedule, resolved, batch)
    return StackSetup(halves, reducer or factory, entry)
