"""The decoder stack's one forward: :func:`decoder_forward`, for every caller.

``WeaveDecoder.__call__`` (the bare stack, the benchmarks) and the serving step run the model
through it with an attention (:class:`StackAttention`: ``nn.prefill.PrefillAttention`` or
``serving.attention.paged_attention.PagedAttention``) and one :class:`ForwardOptions`. It checks the
call, configures the schedule (``weave.schedules.stack_setup``), resolves the attention's
implementation, and runs the layer loop (``nn.stack.run_stack``) per rank in one
``jax.shard_map``. See docs/WEAVE.md#nnforward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.nn.params import partition_specs
from jax_tokenweave.nn.stack import RankAttention, concat, run_stack
from jax_tokenweave.weave.plan import BatchPlan, Half
from jax_tokenweave.weave.schedules import (
    ALL_COLLECTIVES,
    SCHEDULES,
    Collective,
    ReducerFactory,
    Schedule,
    check_call,
    stack_setup,
)
from jax_tokenweave.weave.tuning import TuneEntry

ATTENTION_CHOICES = ("auto", "xla", "cudnn", "cuda")
"""``ForwardOptions.attention``: ``auto`` (what runs here), or an implementation the attention
offers (prefill: ``xla``, ``cudnn``; paged: ``xla``, ``cuda``, ``cudnn``)."""


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """How :func:`decoder_forward` runs the stack (frozen, hashable: a static ``jit`` argument).

    ``schedule``, ``collective``: ``weave.schedules``' names; ``tuning``: the fused kernel's
    CTA counts (None: the plan's); ``attention``: the implementation (:data:`ATTENTION_CHOICES`,
    resolved by the attention); ``key_chunk``: keys per step of the paged ``xla`` loop.
    A bad field raises ``ValueError`` naming it.
    """

    schedule: Schedule = "weave"
    collective: Collective = "auto"
    tuning: TuneEntry | None = None
    attention: str = "auto"
    key_chunk: int = 512

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.collective not in ALL_COLLECTIVES:
            raise ValueError(
                f"collective must be one of {ALL_COLLECTIVES}, got {self.collective!r}"
            )
        if self.tuning is not None and not isinstance(self.tuning, TuneEntry):
            raise ValueError(
                f"tuning must be a tuning.TuneEntry or None, got {type(self.tuning).__name__}"
            )
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(
                f"attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}"
            )
        if isinstance(self.key_chunk, bool) or not isinstance(self.key_chunk, int):
            raise ValueError(f"key_chunk must be an int, got {self.key_chunk!r}")
        if self.key_chunk < 1:
            raise ValueError(f"key_chunk must be >= 1, got {self.key_chunk}")


def forward_options(options: ForwardOptions | None, overrides: dict[str, Any]) -> ForwardOptions:
    """``options`` (None: the defaults) with the fields named in ``overrides`` replaced; an
    unknown name raises ``ValueError`` listing the fields."""
    fields = {f.name for f in dataclasses.fields(ForwardOptions)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown forward options {unknown}; the fields: {sorted(fields)}")
    if options is not None and not isinstance(options, ForwardOptions):
        raise ValueError(f"options must be a ForwardOptions or None, got {type(options).__name__}")
    return dataclasses.replace(options or ForwardOptions(), **overrides)


class StackAttention(Protocol):
    """An attention as a caller hands it to :func:`decoder_forward` (outside ``shard_map``):
    its global operands and their specs, and how to bind them per rank."""

    def resolve(self, requested: str, platform: str, dtype: Any, config: DecoderConfig) -> str:
        """The implementation to run for ``requested`` (``ForwardOptions.attention``) on
        ``platform`` with the model's ``dtype`` and heads; ``ValueError`` where it cannot."""
        ...

    def operands(self) -> Any:
        """The global arrays the per-rank attention reads (a pytree)."""
        ...

    def specs(self, axis_name: str) -> tuple[Any, Any]:
        """``(specs of operands(), specs of the per-rank results())``."""
        ...

    def bind(
        self, operands: Any, halves: tuple[Half, ...], implementation: str, key_chunk: int
    ) -> RankAttention:
        """The per-rank attention of the stack (inside ``shard_map``), on ``operands``'
        per-rank arrays."""
        ...


def decoder_forward(
    decoder: Any,
    hidden: jax.Array,
    batch: BatchPlan,
    attention: StackAttention,
    options: ForwardOptions = ForwardOptions(),
    *,
    reducer: ReducerFactory | None = None,
) -> tuple[jax.Array, Any]:
    """Run ``decoder`` (a ``WeaveDecoder``) on ``hidden`` [T, H] (replicated) laid out as
    ``batch``, with ``attention`` and ``options`` (module docstring).

    Returns ``(final-normed hidden [T, H] replicated, the attention's results)``.
    ``reducer``: a factory replacing the schedule's (the halves stay the schedule's).
    ``collective="ffi"`` where the kernel cannot run raises ``RuntimeError`` saying why.
    """
    config, mesh, axis = decoder.config, decoder.mesh, decoder.axis_name
    dtype = jnp.dtype(decoder.dtype)
    check_call(config, dtype, decoder.tp, hidden, batch, options.schedule, options.collective)
    setup = stack_setup(
        config,
        mesh,
        axis,
        dtype,
        batch,
        schedule=options.schedule,
        collective=options.collective,
        tuning=options.tuning,
        reducer=reducer,
    )
    halves, factory = setup.halves, setup.reducer
    ctx = decoder.context(setup.tuning)
    platform = str(mesh.devices.flat[0].platform)
    implementation = attention.resolve(options.attention, platform, dtype, config)
    graphdef, state = nnx.split(decoder)
    operand_specs, result_specs = attention.specs(axis)

    def per_rank(state: Any, x: jax.Array, operands: Any) -> tuple[jax.Array, Any]:
        bound = attention.bind(operands, halves, implementation, options.key_chunk)
        outs = run_stack(
            nnx.merge(graphdef, state),
            [x[h.start : h.end] for h in halves],
            [bound.half_positions(j) for j in range(len(halves))],
            factory(ctx),
            bound,
        )
        return concat(outs), bound.results()

    fn = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(partition_specs(decoder), P(), operand_specs),
        out_specs=(P(), result_specs),
        check_vma=False,
    )
    return fn(state, hidden, attention.operands())
