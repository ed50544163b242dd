"""Prompt log-probabilities (vLLM's ``SamplingParams.prompt_logprobs``): for each prompt token
after the first, its log-probability given the tokens before it, its rank and the most likely
tokens there, from the rows of the steps that prefill the prompt.

A step with such a prompt chunk runs the forward's variant that also projects every row's
final hidden state to the vocabulary, in blocks of rows (:func:`compute`), against each row's
target: the prompt token after the row's (``StepArrays.prompt_targets``, -1 where none). That
variant is compiled at its first use per step layout (``warmup`` does not make it). Only sample
0 of a request computes them (the samples share the prompt).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

ArrayT = TypeVar("ArrayT")
BLOCK_ROWS = 128
"""Rows projected to the vocabulary at once (bounds the float32 [rows, V] logits alive)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PromptLogprobs(Generic[ArrayT]):
    """Per step row [R]: the target's ``logprob`` and ``rank`` (1: the most likely; 0 where the
    row has no target), the ``top_logprobs`` / ``top_ids`` [R, K] most likely."""

    logprob: ArrayT
    rank: ArrayT
    top_logprobs: ArrayT
    top_ids: ArrayT


def compute(model: Any, hidden: jax.Array, targets: jax.Array, num_top: int) -> PromptLogprobs:
    """:class:`PromptLogprobs` of ``hidden`` [R, H] (final-normed, replicated) against
    ``targets`` int32 [R]: ``model.logits`` of :data:`BLOCK_ROWS` rows at a time, their
    ``log_softmax``, the target's entry and rank (vLLM's: tokens at least as likely), and the
    ``num_top`` largest."""
    rows = hidden.shape[0]
    block = math.gcd(rows, BLOCK_ROWS)

    def one(args: tuple[jax.Array, jax.Array]) -> PromptLogprobs:
        h, t = args
        lp = jax.nn.log_softmax(model.logits(h).astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(lp, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
        rank = jnp.where(t >= 0, jnp.sum(lp >= chosen[:, None], axis=-1), 0).astype(jnp.int32)
        if num_top:
            top, ids = jax.lax.top_k(lp, num_top)
        else:
            top, ids = jnp.zeros((block, 0), jnp.float32), jnp.zeros((block, 0), jnp.int32)
        return PromptLogprobs(jnp.where(t >= 0, chosen, 0.0), rank, top, ids.astype(jnp.int32))

    out = jax.lax.map(
        one, (hidden.reshape(rows // block, block, -1), targets.reshape(rows // block, block))
    )
    return jax.tree_util.tree_map(lambda x: x.reshape(rows, *x.shape[2:]), out)


def targets(
    chunks: Any, first_rows: np.ndarray, rows: int
) -> tuple[np.ndarray, list[tuple[Any, int, int, int]]]:
    """The targets int32 [rows] of a step's ``chunks`` (``scheduler.Chunk``; ``first_rows``
    [C] their first rows) and ``(request, first row, first position, count)`` of each chunk
    whose request asks (sample 0 only): the rows whose next prompt token is a target."""
    out = np.full(rows, -1, np.int32)
    asked = []
    for chunk, first in zip(chunks, first_rows.tolist(), strict=True):
        seq = chunk.seq
        if seq.params.prompt_logprobs is None or seq.index:
            continue
        count = min(chunk.length, len(seq.prompt) - 1 - chunk.start)  # the last has no target
        if count > 0:
            out[first : first + count] = seq.prompt[chunk.start + 1 : chunk.start + 1 + count]
            asked.append((seq, first, chunk.start, count))
    return out, asked
