"""vLLM's logits processors on the device, per request: presence, frequency and repetition
penalties, ``logit_bias`` and ``min_tokens``; their values are traced (new values compile
nothing). Each running request has a slot (``scheduler.Request.slot``); :class:`ProcessorState`
holds per slot its token history and bias table, written at admission (:func:`start_slot`);
the processed sampler (``serving.runner.sampler``) runs :func:`apply` and :func:`record`. Layout and
costs: docs/SERVING.md#servingsamplingprocessors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_tokenweave.serving.buckets import next_pow2
from jax_tokenweave.serving.sampling_params import INT32_MAX, SamplingParams

PROMPT_BIT = 1 << 30
"""The history's flag for a prompt token; the bits below count the token among the new ones."""
MIN_PROMPT_BUCKET = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ProcessorState:
    """Per slot [M + 1, ...] (module docstring): ``history`` int32 [., V]; ``bias_ids`` int32,
    ``bias_values`` float32, ``bias_until`` int32 [., K]."""

    history: jax.Array
    bias_ids: jax.Array
    bias_values: jax.Array
    bias_until: jax.Array


def needs_slot(params: SamplingParams) -> bool:
    """Whether a request's slot must be written at admission (a penalty or a bias)."""
    return params.penalized or params.biased


def processed_until(params: SamplingParams) -> int:
    """The steps that sample a request's tokens before this count (0-based) process its row:
    all of them with a penalty or a ``logit_bias``, else those before ``min_tokens``."""
    return INT32_MAX if params.penalized or params.logit_bias else params.min_tokens


def bias_entries(params: SamplingParams, stop_ids: Collection[int]) -> list[tuple[int, float, int]]:
    """``(token id, bias, until)`` of a request: its ``logit_bias`` (until never), then ``-inf``
    on its stop ids (``stop_token_ids`` and EOS unless ``ignore_eos``) until ``min_tokens``."""
    out = [(t, b, INT32_MAX) for t, b in (params.logit_bias or {}).items()]
    if params.min_tokens:
        out += [(t, -np.inf, params.min_tokens) for t in sorted(stop_ids)]
    return out


def prompt_bucket(n: int) -> int:
    """The padded length of a slot's distinct token ids (a power of two, at least 64)."""
    return max(MIN_PROMPT_BUCKET, next_pow2(n))


def prompt_buckets(max_model_len: int, vocab: int) -> list[int]:
    """Every :func:`prompt_bucket` a request's distinct ids can take (for warm-up)."""
    top = prompt_bucket(min(max_model_len, vocab))
    return [b for b in (MIN_PROMPT_BUCKET << i for i in range(32)) if b <= top]


@dataclasses.dataclass(frozen=True)
class SlotStart:
    """The host arrays of one :func:`start_slot` call: the slot, the request's distinct token
    ids (int32 [bucket], padded with V: dropped) and their history values (int32 [bucket]),
    and the bias table row (three [K] arrays)."""

    slot: int
    ids: np.ndarray
    history: np.ndarray
    bias_ids: np.ndarray
    bias_values: np.ndarray
    bias_until: np.ndarray


def slot_start(
    slot: int,
    prompt: Sequence[int],
    output: Sequence[int],
    entries: list[tuple[int, float, int]],
    vocab: int,
    k: int,
) -> SlotStart:
    """:class:`SlotStart` of a request in ``slot`` with ``prompt`` ids, the tokens it made
    already (``output``: a preempted request's, recomputed) and bias ``entries`` (at most
    ``k``)."""
    if len(entries) > k:
        raise ValueError(f"{len(entries)} biased tokens exceed max_biased_tokens ({k})")
    prompt_ids = np.unique(np.asarray(prompt, np.int32))
    made, counts = np.unique(np.asarray(output, np.int32), return_counts=True)
    ids = np.union1d(prompt_ids, made).astype(np.int32)
    history = np.where(np.isin(ids, prompt_ids), PROMPT_BIT, 0).astype(np.int32)
    history[np.searchsorted(ids, made)] += counts.astype(np.int32)
    bucket = prompt_bucket(ids.size)
    ids = np.concatenate([ids, np.full(bucket - ids.size, vocab, np.int32)])
    history = np.concatenate([history, np.zeros(bucket - history.size, np.int32)])
    table = (np.zeros(k, np.int32), np.zeros(k, np.float32), np.zeros(k, np.int32))
    for column, values in zip(table, zip(*entries, strict=True), strict=False):
        column[: len(values)] = values
    return SlotStart(slot, ids, history, *table)


def init_state(mesh: Mesh, slots: int, vocab: int, k: int) -> ProcessorState:
    """A zeroed :class:`ProcessorState` of ``slots`` + 1 rows, replicated over ``mesh``."""
    put = lambda shape, dtype: jax.device_put(np.zeros(shape, dtype), NamedSharding(mesh, P()))
    rows = slots + 1
    return ProcessorState(
        put((rows, vocab), np.int32),
        put((rows, k), np.int32),
        put((rows, k), np.float32),
        put((rows, k), np.int32),
    )


def state_bytes(slots: int, vocab: int, k: int) -> int:
    """Bytes of :func:`init_state`'s arrays on each device."""
    return (slots + 1) * (4 * vocab + 12 * k)


def start_slot(
    state: ProcessorState,
    slot: jax.Array,
    ids: jax.Array,
    history: jax.Array,
    bias_ids: jax.Array,
    bias_values: jax.Array,
    bias_until: jax.Array,
) -> ProcessorState:
    """Slot ``slot``'s rows made new: its history ``history`` at token ``ids`` (int32 [B]
    each; ids >= V dropped), zero elsewhere; its bias table the given [K] row."""
    vocab = state.history.shape[1]
    row = jnp.zeros(vocab, jnp.int32).at[ids].set(history, mode="drop")
    put = lambda table, value: table.at[slot].set(value)
    return ProcessorState(
        put(state.history, row),
        put(state.bias_ids, bias_ids),
        put(state.bias_values, bias_values),
        put(state.bias_until, bias_until),
    )


jitted_start_slot = jax.jit(start_slot, donate_argnames=("state",))
""":func:`start_slot`, jitted: one small program per prompt bucket."""


def apply(
    logits: jax.Array,
    state: ProcessorState,
    slots: jax.Array,
    counters: jax.Array,
    penalties: jax.Array,
) -> jax.Array:
    """vLLM's processed logits [S, V] (float32) of ``logits`` [S, V]: each row's bias entries
    that hold (``counters`` [S] < until) added, then its penalties (``penalties`` [S, 3]:
    presence, frequency, repetition) over its slot's history (``slots`` [S])."""
    logits = logits.astype(jnp.float32)
    rows = jnp.arange(logits.shape[0])[:, None]
    holds = counters[:, None] < state.bias_until[slots]
    bias = jnp.where(holds, state.bias_values[slots], 0.0)
    logits = logits.at[rows, state.bias_ids[slots]].add(bias)
    history = state.history[slots]  # [S, V]
    counts = (history & (PROMPT_BIT - 1)).astype(jnp.float32)
    presence, frequency, repetition = (penalties[:, i : i + 1] for i in range(3))
    scale = jnp.where(history != 0, repetition, 1.0)
    logits = jnp.where(logits > 0, logits / scale, logits * scale)
    return logits - frequency * counts - presence * (counts > 0)


def record(history: jax.Array, slots: jax.Array, tokens: jax.Array) -> jax.Array:
    """``history`` with one more of ``tokens`` [S] counted in ``slots`` [S]."""
    return history.at[slots, tokens].add(1)
