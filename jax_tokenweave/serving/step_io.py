"""The forward program's inputs and logits at fixed device addresses, so that XLA's command
buffers (CUDA graphs) replay a step without updating its kernels.

XLA updates a recorded graph before a replay wherever a buffer it reads moved, at about 2-4 us
per kernel node and a re-capture per custom call; the step's inputs are new device buffers each
step and its logits a new output, and on one H200 (Llama-3-8B shapes, batch 1) that updated 166
to 389 of the forward's 389 commands per step, 0.4-2.2 ms (``benchmarks/results``). So the
forward takes its inputs packed into one int32 vector and copies them, with the previous
step's tokens, into :class:`StepIO` ``inputs``, a buffer it is donated and gives back, and
writes the logits into ``logits``, donated the same way. Only the copy reads a new buffer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_tokenweave.serving.batch import StepArrays, StepLayout

INPUT_FIELDS = ("tokens", "token_source", "positions", "slots", "tables", "sample_rows")
"""The ``StepArrays`` fields the forward reads, in their packed order (the rest: sampling)."""


class ForwardInputs(NamedTuple):
    """The forward's view of a step's inputs (device arrays, int32)."""

    tokens: jax.Array  # [R]
    token_source: jax.Array  # [R]
    positions: jax.Array  # [R]
    slots: jax.Array  # [R]
    tables: jax.Array  # [G, W]
    sample_rows: jax.Array  # [S]


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
    return 4 * layout.rows + layout.groups * table_width + layout.samples


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
    io: StepIO, packed: jax.Array, prev_tokens: jax.Array, layout: StepLayout
) -> tuple[jax.Array, ForwardInputs, jax.Array]:
    """Inside the forward: copy ``packed`` [N] and ``prev_tokens`` [P] into ``io.inputs`` and
    read every input from there. Returns the new ``inputs`` buffer (give it back in the
    :class:`StepIO`), the fields, and the previous tokens. The optimization barrier keeps XLA
    from reading the fields straight from ``packed``, whose address changes every step."""
    n = packed.shape[0]
    r, g, s = layout.rows, layout.groups, layout.samples
    width = (n - 4 * r - s) // g
    if 4 * r + g * width + s != n or io.inputs.shape[0] != n + prev_tokens.shape[0]:
        raise ValueError(
            f"packed inputs of {n} values and {prev_tokens.shape[0]} previous tokens do not "
            f"fit layout {layout} and its {io.inputs.shape[0]}-value input buffer"
        )
    new = jnp.concatenate([packed.astype(jnp.int32), prev_tokens.astype(jnp.int32)])
    flat = jax.lax.dynamic_update_slice(io.inputs, new, (0,))
    flat = jax.lax.optimization_barrier(flat)
    shapes: list[tuple[int, ...]] = [(r,), (r,), (r,), (r,), (g, width), (s,)]
    fields: list[Any] = []
    start = 0
    for shape in shapes:
        size = int(np.prod(shape))
        fields.append(flat[start : start + size].reshape(shape))
        start += size
    return flat, ForwardInputs(*fields), flat[n:]


def give_back(io: StepIO, inputs: jax.Array, logits: jax.Array) -> StepIO:
    """Inside the forward: the :class:`StepIO` it returns, the logits written into the donated
    ``io.logits`` (same shape, so in place)."""
    return StepIO(
        inputs, jax.lax.dynamic_update_slice(io.logits, logits.astype(jnp.float32), (0, 0))
    )
