"""Reducers: what the decoder stack does after each row-parallel GEMM, per rank.

A reducer, made per trace from a :class:`ReduceContext` (by a class below or any
``Callable[[ReduceContext], Reducer]``), holds per half ``j`` the normed input ``x[j]`` [T_j, H]
replicated and ``residual[j]``: replicated [T_j, H], or this rank's ``ceil(T_j/N)`` rows when
``sharded``. Protocol: ``begin``, ``ready(j)``, ``reduce(j, partial, weight)``, ``finish()``.
:class:`Psum`, :class:`Local`, :class:`Sharded`, :class:`Replicated`, :class:`LocalSharded`,
:class:`Overlap`; ``Local`` and ``LocalSharded`` do NOT compute the model. See
docs/WEAVE.md#weavereducers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jax_tokenweave.kernel import ops
from jax_tokenweave.weave.tuning import DEFAULT_ENTRY, TuneEntry


@dataclasses.dataclass(frozen=True)
class ReduceContext:
    """What every reducer needs: the TP axis, the concrete mesh (for the fused kernel), the
    RMSNorm epsilon and the kernel's CTA counts (``tuning``)."""

    axis_name: str
    mesh: Mesh | None
    eps: float
    tuning: TuneEntry = DEFAULT_ENTRY


def own_rows(x: jax.Array, axis_name: str) -> jax.Array:
    """Per rank: this rank's ``ceil(T/N)`` rows of ``x`` [T, H] (zero rows past T), the
    token-sharded residual layout of ``ops.allreduce_rmsnorm``."""
    n = jax.lax.axis_size(axis_name)
    rows = ops.rows_per_rank(x.shape[0], n)
    if rows * n != x.shape[0]:
        x = jnp.pad(x, ((0, rows * n - x.shape[0]), (0, 0)))
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis_name) * rows, rows, 0)


class Reducer:
    """Base class: the per-half state and the synchronous protocol (module docstring).

    Subclasses set ``sharded`` and implement :meth:`combine`.
    """

    sharded: bool = False

    def __init__(self, ctx: ReduceContext) -> None:
        self.ctx = ctx
        self.x: list[jax.Array] = []
        self.residual: list[jax.Array] = []
        self._calls = 0

    def begin(self, inputs: Sequence[jax.Array], weight: jax.Array) -> None:
        """Take the halves' inputs [T_j, H] (replicated); ``x`` = RMSNorm(input, ``weight``)."""
        self.x = [ops.rms_norm(h, weight, self.ctx.eps) for h in inputs]
        self.residual = [own_rows(h, self.ctx.axis_name) if self.sharded else h for h in inputs]

    def ready(self, j: int) -> jax.Array:
        """Half ``j``'s normed input for its next compute, [T_j, H] replicated."""
        return self.x[j]

    def reduce(self, j: int, partial: jax.Array, weight: jax.Array) -> None:
        """Reduce half ``j``'s ``partial`` [T_j, H] into its residual; norm with ``weight``."""
        self.x[j], self.residual[j] = self.combine(j, partial, self.residual[j], weight)

    def finish(self) -> list[jax.Array]:
        """Every half's final normed output."""
        return [self.ready(j) for j in range(len(self.x))]

    def combine(
        self, j: int, partial: jax.Array, residual: jax.Array, weight: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError

    def next_ctas(self) -> int | None:
        """CTAs of the next fused call: ``tuning.first_num_ctas`` for the stack's first one."""
        self._calls += 1
        return self.ctx.tuning.ctas(self._calls == 1)


class Psum(Reducer):
    """Plain TP: all-reduce (XLA ``psum``), add, RMSNorm on all rows; residual replicated."""

    def combine(self, j, partial, residual, weight):
        return ops.allreduce_rmsnorm(
            partial, residual, weight, axis_name=self.ctx.axis_name, eps=self.ctx.eps, impl="xla"
        )


class Local(Reducer):
    """No communication, residual replicated: each rank adds its own partial (not the model)."""

    def combine(self, j, partial, residual, weight):
        return ops.add_rmsnorm(partial, residual, weight, self.ctx.eps)


class Sharded(Reducer):
    """``ops.allreduce_rmsnorm`` with a token-sharded residual: ``impl`` is ``xla_rsag``,
    ``ffi`` (the synchronous fused kernel, on workspace slot ``j``) or ``auto``."""

    sharded = True

    def __init__(self, ctx: ReduceContext, impl: str = "xla_rsag") -> None:
        super().__init__(ctx)
        self.impl = impl

    def combine(self, j, partial, residual, weight):
        return ops.allreduce_rmsnorm(
            partial,
            residual,
            weight,
            axis_name=self.ctx.axis_name,
            eps=self.ctx.eps,
            impl=self.impl,
            mesh=self.ctx.mesh,
            slot=j,
            num_ctas=self.next_ctas() if self.impl == "ffi" else None,
            algo=(self.ctx.tuning.algo or "auto") if self.impl == "ffi" else "auto",
        )


class Replicated(Sharded):
    """The synchronous fused kernel with the residual replicated (``impl="ffi_replicated"``, slot
    ``j``, the kernel policy's CTAs, at least T): a whole decode-size batch, where no rank then
    needs another's residual rows (measured faster than the token-sharded call at TP 2 and 4)."""

    sharded = False

    def __init__(self, ctx: ReduceContext) -> None:
        super().__init__(ctx, "ffi_replicated")


def sharded(impl: str) -> Callable[[ReduceContext], Sharded]:
    """A factory of :class:`Sharded` reducers with ``impl``."""
    return lambda ctx: Sharded(ctx, impl)


class LocalSharded(Reducer):
    """The weave layout with a comm-free stand-in for each collective (not the model): add +
    RMSNorm on this rank's own rows of its partial and residual, tiled back to T rows."""

    sharded = True

    def combine(self, j, partial, residual, weight):
        axis = self.ctx.axis_name
        normed, summed = ops.add_rmsnorm(own_rows(partial, axis), residual, weight, self.ctx.eps)
        tiled = jnp.tile(normed, (jax.lax.axis_size(axis), 1))
        return tiled[: partial.shape[0]], summed


class Overlap(Reducer):
    """The fused kernel as start/done pairs overlapped with the other half (two halves).

    ``start``/``done`` default to ``kernel._ffi.allreduce_rmsnorm_start/done``. Ordered by data
    (``optimization_barrier``): :meth:`ready` does ``done(j)`` after the other half's latest
    ``start``; :meth:`reduce` does ``start(j)`` on slot ``j``; :meth:`finish` does ``done(A)``
    then ``done(B)``. Signatures and the ordering step by step: docs/WEAVE.md#weavereducersoverlap.
    """

    sharded = True

    def __init__(
        self,
        ctx: ReduceContext,
        start: Callable[..., Any] | None = None,
        done: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__(ctx)
        self._start, self._done = start, done
        self.pending: list[Any] = []

    def begin(self, inputs: Sequence[jax.Array], weight: jax.Array) -> None:
        if len(inputs) != 2:
            raise ValueError(f"the overlapped reducer needs two halves, got {len(inputs)}")
        super().begin(inputs, weight)
        self.pending = [None, None]

    def _kernel(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        if self._start is None or self._done is None:
            from jax_tokenweave.kernel import _ffi

            return (
                self._start or _ffi.allreduce_rmsnorm_start,
                self._done or _ffi.allreduce_rmsnorm_done,
            )
        return self._start, self._done

    def ready(self, j: int) -> jax.Array:
        other, pending = 1 - j, self.pending
        if pending[j] is not None:
            if pending[other] is not None:
                pending[j], pending[other] = jax.lax.optimization_barrier(
                    (pending[j], pending[other])
                )
            self.x[j], self.residual[j] = self._kernel()[1](
                pending[j], axis_name=self.ctx.axis_name, mesh=self.ctx.mesh, slot=j
            )
            pending[j] = None
        elif pending[other] is not None:
            pending[other], self.x[j] = jax.lax.optimization_barrier((pending[other], self.x[j]))
        return self.x[j]

    def reduce(self, j: int, partial: jax.Array, weight: jax.Array) -> None:
        self.pending[j] = self._kernel()[0](
            partial,
            self.residual[j],
            weight,
            axis_name=self.ctx.axis_name,
            mesh=self.ctx.mesh,
            eps=self.ctx.eps,
            num_ctas=self.next_ctas(),
            slot=j,
            algo=self.ctx.tuning.algo or "auto",
        )
