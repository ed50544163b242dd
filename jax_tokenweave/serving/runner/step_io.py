"""The forward program's inputs and logits at fixed device addresses, so that XLA's command
buffers (CUDA graphs) replay a step without updating its kernels.

XLA updates a recorded graph wherever a buffer it reads moved (about 2-4 us per kernel node,
a re-capture per custom call): with new input buffers and a new logits output every step,
166-389 of the forward's 389 commands per step (one H200, ``benchmarks/results``). So the
forward copies its packed inputs and the previous tokens into :class:`StepIO` ``inputs``, a
buffer it is donated and gives back, and writes the logits into the donated ``logits``; only
the copy reads a new buffer. Steps that are not replayed keep no buffers (no ``io``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_tokenweave.serving.runner.batch import StepArrays, StepLayout


class ForwardInputs(NamedTuple):
    """The forward's view of a step's inputs (device arrays, int32)."""

    tokens: jax.Array  # [R]
    token_source: jax.Array  # [R]
    positions: jax.Array  # [R]
    slots: jax.Array  # [R]
    tables: jax.Array  # [G, W]
    sample_rows: jax.Array  # [S]


INPUT_FIELDS = ForwardInputs._fields
"""The ``StepArrays`` fields the forward reads, in their packed order (the rest: sampling)."""


def _field_shapes(layout: StepLayout, table_width: int) -> list[tuple[int, ...]]:
    """The shapes of :data:`INPUT_FIELDS` for ``layout``, in order."""
    r, g, s = layout.rows, layout.groups, layout.samples
    return [(r,), (r,), (r,), (r,), (g, table_width), (s,)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepIO:
    """Device buffers of one layout's forward, donated to it and given back by it each step."""

    inputs: jax.Array  # int32 [N + P]: the packed inputs (N), then the previous tokens (P)
    logits: jax.Array  # float32 [S, V]: the sampled rows' logits


def pack_inputs(arrays: StepArrays) -> np.ndarray:
    """The forward's fields of ``arrays``, flattened into one int32 vector [N] (one transfer)."""
    return np.concatenate(
        [np.asarray(getattr(arrays, name), np.int32).ravel() for name in INPUT_FIELDS]
    )


def input_size(layout: StepLayout, table_width: int) -> int:
    """``N``: the length of :func:`pack_inputs`' vector for ``layout``."""
    return sum(int(np.prod(shape)) for shape in _field_shapes(layout, table_width))


def new_io(layout: StepLayout, table_width: int, prev: int, vocab: int, mesh: Mesh) -> StepIO:
    """Zeroed :class:`StepIO` of ``layout``, replicated over ``mesh``; ``prev``: the previous
    tokens' length (``max_num_seqs``)."""
    replicated = NamedSharding(mesh, P())
    n = input_size(layout, table_width) + prev
    return StepIO(
        jax.device_put(np.zeros(n, np.int32), replicated),
        jax.device_put(np.zeros((layout.samples, vocab), np.float32), replicated),
    )


def stage_inputs(
    io: StepIO | None, packed: jax.Array, prev_tokens: jax.Array, layout: StepLayout
) -> tuple[jax.Array, ForwardInputs, jax.Array]:
    """Inside the forward: ``packed`` [N] and ``prev_tokens`` [P] as one int32 vector, copied
    into ``io.inputs`` (donated) where an ``io`` is given, and the fields read from it. Returns
    that vector (the ``inputs`` of :func:`give_back`), the fields and the previous tokens. The
    optimization barrier keeps XLA from reading the fields straight from ``packed``, whose
    address changes every step. ``io`` None: a step that is not replayed; nothing is kept."""
    n, g = packed.shape[0], layout.groups
    width = (n - input_size(layout, 0)) // g
    fits = input_size(layout, width) == n
    if not fits or (io is not None and io.inputs.shape[0] != n + prev_tokens.shape[0]):
        raise ValueError(
            f"packed inputs of {n} values and {prev_tokens.shape[0]} previous tokens do not "
            f"fit layout {layout}"
            + ("" if io is None else f" and its {io.inputs.shape[0]}-value input buffer")
        )
    flat = jnp.concatenate([packed.astype(jnp.int32), prev_tokens.astype(jnp.int32)])
    if io is not None:
        flat = jax.lax.dynamic_update_slice(io.inputs, flat, (0,))
        flat = jax.lax.optimization_barrier(flat)
    fields: list[Any] = []
    start = 0
    for shape in _field_shapes(layout, width):
        size = int(np.prod(shape))
        fields.append(flat[start : start + size].reshape(shape))
        start += size
    return flat, ForwardInputs(*fields), flat[n:]


def give_back(io: StepIO | None, inputs: jax.Array, logits: jax.Array) -> StepIO:
    """Inside the forward: the :class:`StepIO` it returns, the logits (float32) written into
    the donated ``io.logits`` (same shape, so in place), or new where ``io`` is None."""
    logits = logits.astype(jnp.float32)
    if io is None:
        return StepIO(inputs, logits)
    return StepIO(inputs, jax.lax.dynamic_update_slice(io.logits, logits, (0, 0)))
