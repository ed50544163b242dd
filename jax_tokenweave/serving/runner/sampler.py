"""The serving step's sampler programs: one token per sampled row of the forward's logits, the
asked-for log-probabilities, and the tokens laid out to feed the next step. The host picks the
program per step (no ``lax.cond`` on the device): greedy or drawn, with log-probabilities or
not, and processed (``serving.sampling.processors``: penalties, ``logit_bias``, ``min_tokens``) or
not; a processed program updates the token history it is donated. Log-probabilities are the model's
(of the logits before processing and temperature), as vLLM's default ``raw_logprobs``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_tokenweave.serving.runner.batch import StepArrays
from jax_tokenweave.serving.sampling import processors, sampling
from jax_tokenweave.serving.sampling.processors import ProcessorState

TokensT = TypeVar("TokensT")
LogprobsT = TypeVar("LogprobsT")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOutputs(Generic[TokensT, LogprobsT]):
    """Per sampled row [S]: ``tokens`` (int32 [P], zero-padded to the previous tokens'
    length ``P`` where the step took them, so they can feed the next step; else [S]), their
    ``logprob``; ``top_logprobs`` / ``top_ids`` [S, K] (K = the static number asked for;
    [S, 0] when none). The last three are zeros where the step's ``want_logprobs`` is false.

    A step's outputs are device arrays (:data:`DeviceOutputs`); ``ModelRunner.fetch`` brings
    them to the host (:data:`HostOutputs`)."""

    tokens: TokensT
    logprob: LogprobsT
    top_logprobs: LogprobsT
    top_ids: LogprobsT


DeviceOutputs = StepOutputs[jax.Array, jax.Array]
"""A step's outputs on the device, as the sampler returns them."""
HostOutputs = StepOutputs[np.ndarray, np.ndarray | None]
"""A step's outputs on the host (``ModelRunner.fetch``): NumPy arrays, the log-probability
fields None where the step did not want them."""

SAMPLERS = ("greedy", "sample")
"""``greedy``: every sampled row has temperature 0 (an argmax); ``sample``: any row may draw
(``sampling.sample``, which sorts the vocabulary)."""


def _outputs(
    tokens: jax.Array,
    logits: jax.Array,
    prev_tokens: jax.Array | None,
    num_logprobs: int,
    mesh: Mesh | None,
) -> DeviceOutputs:
    """``StepOutputs`` of the sampled ``tokens`` [S]: their log-probabilities under ``logits``
    [S, V] where ``num_logprobs``, the tokens zero-padded to ``prev_tokens``' length."""
    n = tokens.shape[0]
    if num_logprobs:
        chosen, top, ids = sampling.logprobs(logits, tokens, num_logprobs)
    else:
        chosen, top, ids = (
            jnp.zeros(n, jnp.float32),
            jnp.zeros((n, 0), jnp.float32),
            jnp.zeros((n, 0), jnp.int32),
        )
    if prev_tokens is not None:  # [P], replicated: the next step's prev_tokens
        if n > prev_tokens.shape[0]:
            raise ValueError(f"{n} sampled rows exceed prev_tokens' {prev_tokens.shape[0]}")
        tokens = jnp.zeros_like(prev_tokens).at[:n].set(tokens)
        if mesh is not None:
            tokens = jax.lax.with_sharding_constraint(tokens, NamedSharding(mesh, P()))
    return StepOutputs(tokens, chosen, top, ids)


def _choose(
    logits: jax.Array,
    seeds: jax.Array,
    counters: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    sampler: str,
) -> jax.Array:
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    if sampler == "greedy":
        return sampling.greedy(logits)
    return sampling.sample(logits, seeds, counters, temperature, top_p, top_k)


def sample_step(
    logits: jax.Array,
    seeds: jax.Array,
    counters: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    prev_tokens: jax.Array | None = None,
    *,
    sampler: str,
    num_logprobs: int,
    mesh: Mesh | None = None,
) -> DeviceOutputs:
    """One token per row of ``logits`` [S, V] (``sampler``, one of :data:`SAMPLERS`; the
    sampling settings are [S], as ``StepArrays``'), with ``num_logprobs`` top
    log-probabilities (0: none; the log-probability fields are then zeros [S] and [S, 0]).
    With ``prev_tokens`` [P], the tokens come back zero-padded to [P] (replicated over
    ``mesh`` where given), to feed the next step."""
    tokens = _choose(logits, seeds, counters, temperature, top_p, top_k, sampler)
    return _outputs(tokens, logits, prev_tokens, num_logprobs, mesh)


def processed_sample_step(
    logits: jax.Array,
    seeds: jax.Array,
    counters: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    prev_tokens: jax.Array | None,
    state: ProcessorState,
    slots: jax.Array,
    penalties: jax.Array,
    *,
    sampler: str,
    num_logprobs: int,
    mesh: Mesh | None = None,
) -> tuple[DeviceOutputs, ProcessorState]:
    """:func:`sample_step` of the processed logits (``processors.apply`` with the rows'
    ``slots`` [S] and ``penalties`` [S, 3]); returns the outputs and ``state`` with the tokens
    recorded in its history (donated when jitted). Log-probabilities: of the raw ``logits``."""
    chosen = processors.apply(logits, state, slots, counters, penalties)
    tokens = _choose(chosen, seeds, counters, temperature, top_p, top_k, sampler)
    history = processors.record(state.history, slots, tokens)
    if mesh is not None:
        history = jax.lax.with_sharding_constraint(history, NamedSharding(mesh, P()))
    out = _outputs(tokens, logits, prev_tokens, num_logprobs, mesh)
    return out, dataclasses.replace(state, history=history)


def sampling_arrays(arrays: StepArrays) -> tuple[Any, Any, Any, Any, Any]:
    """The sampling settings of a step, in :func:`sample_step`'s order."""
    return arrays.seeds, arrays.counters, arrays.temperature, arrays.top_p, arrays.top_k


jitted_sampler = jax.jit(sample_step, static_argnames=("sampler", "num_logprobs", "mesh"))
""":func:`sample_step`, jitted: one small program per (rows, sampler, log-probabilities)."""

jitted_processed_sampler = jax.jit(
    processed_sample_step,
    static_argnames=("sampler", "num_logprobs", "mesh"),
    donate_argnames=("state",),
)
""":func:`processed_sample_step`, jitted, its ``state`` donated: one more small program per
(rows, sampler, log-probabilities), whatever the penalty and bias values."""
