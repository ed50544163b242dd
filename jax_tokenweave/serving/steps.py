"""The two jitted serving steps: ``prefill`` (prompts -> cache + first token) and ``decode``.

Both are pure functions of ``(model state, cache, ...)`` with static shapes; the engine
(``serving.engine``) jits them once per shape bucket and donates the cache. Both take a
``schedule`` (``weave`` or ``baseline``) and a ``comm`` (``auto``, ``xla``, ``ffi``), the words
``WeaveDecoder`` uses.

* Prefill: ``P`` prompts, each padded at its end to the bucket length ``Lb``, packed back to
  back (``P * Lb`` tokens) and laid out as ``plan_batch([Lb] * P)``: the weave schedule splits
  the batch when it has at least ``weave_threshold`` tokens (or always/never when forced). The
  padding sits after each prompt's real tokens, so causal attention keeps it out of the real
  tokens' results; its K/V land in cache positions the decode mask hides until overwritten.
* Decode: one token per cache row, ``B`` rows; no split. Per layer: q/k/v of the new token, its
  K/V written into the cache at its position, attention over the row's positions
  ``0..position``, then ``allreduce_rmsnorm``: ``weave`` keeps the residual token-sharded
  (``ceil(B/N)`` rows per rank) and reduces with ``comm`` (``xla``: reduce-scatter, norm,
  all-gather; ``ffi``: the fused kernel; ``auto``: ffi where it can run); ``baseline`` is
  all-reduce (psum) with the residual replicated.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_tokenweave import reducers
from jax_tokenweave.layers import COMMS, WeaveDecoder
from jax_tokenweave.params import partition_specs
from jax_tokenweave.serving.kv_cache import KVCache, cache_spec, decode_attention, write_prompts
from jax_tokenweave.serving.sampling import sample
from jax_tokenweave.split import BatchPlan
from jax_tokenweave.stack import run_stack
from jax_tokenweave.tuning import POLICY_ENTRY

SERVING_SCHEDULES = ("weave", "baseline")
_WEAVE_IMPL = {"auto": "auto", "xla": "xla_rsag", "ffi": "ffi"}


def decode_impl(schedule: str, comm: str) -> str:
    """The ``ops.allreduce_rmsnorm`` impl of a decode step: ``baseline`` -> ``xla`` (psum,
    replicated residual); ``weave`` -> ``comm``'s token-sharded impl."""
    if schedule not in SERVING_SCHEDULES:
        raise ValueError(f"schedule must be one of {SERVING_SCHEDULES}, got {schedule!r}")
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
    return "xla" if schedule == "baseline" else _WEAVE_IMPL[comm]


def prefill(model: Any, cache: KVCache, tokens: jax.Array, last_index: jax.Array,
            rows: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array, *,
            plan: BatchPlan, schedule: str, comm: str) -> tuple[jax.Array, jax.Array, KVCache]:
    """Run ``P`` padded prompts, fill their cache rows, sample each one's first new token.

    Args:
      model: a causal LM with ``decoder`` (``WeaveDecoder``), ``embed_tokens(tokens)`` and
        ``logits(hidden)`` (``models.llama.LlamaModel``).
      tokens: int32 [P, Lb], each prompt padded at its end.
      last_index: int32 [P], index of each prompt's last real token (its length - 1).
      rows: int32 [P], cache row per prompt; ``>= cache.num_rows`` for padding prompts.
      plan: ``plan_batch([Lb] * P, ...)``.

    Returns:
      ``(next_tokens int32 [P], logits float [P, V] of each last real token, cache)``.
    """
    p, lb = tokens.shape
    hidden = model.embed_tokens(tokens.reshape(-1))
    out, kvs = model.decoder(hidden, plan, schedule=schedule, comm=comm, return_kv=True)
    for i, (k, v) in enumerate(kvs):
        cache = write_prompts(cache, i, k.reshape(p, lb, *k.shape[1:]),
                              v.reshape(p, lb, *v.shape[1:]), rows)
    last = out.reshape(p, lb, -1)[jnp.arange(p), last_index]
    logits = model.logits(last)
    return sample(logits, key, temperature, top_p), logits, cache


def decode(model: Any, cache: KVCache, tokens: jax.Array, positions: jax.Array,
           key: jax.Array, temperature: jax.Array, top_p: jax.Array, *,
           schedule: str = "weave", comm: str = "auto") -> tuple[jax.Array, jax.Array, KVCache]:
    """One new token for each of the ``B`` cache rows.

    ``tokens`` int32 [B] (each row's latest token), ``positions`` int32 [B] (its position: the
    row's sequence length before this token). Returns ``(next int32 [B], logits [B, V],
    cache)``. Rows not in use may hold anything; their outputs are meaningless and harmless.
    """
    hidden = model.embed_tokens(tokens)
    x, k, v = decoder_step(model.decoder, hidden, positions, cache.k, cache.v,
                           schedule=schedule, comm=comm)
    logits = model.logits(x)
    return sample(logits, key, temperature, top_p), logits, KVCache(k, v)


class CacheAttention:
    """The stack's attention function for decode (``stack.AttentionFn``), per rank: writes each
    row's new K/V into the cache at its position, then attends over the row's positions
    ``0..position``. ``k``, ``v``: the caches [L, B, S, KVH/N, D] (updated as layers run);
    ``positions``: int32 [B]."""

    def __init__(self, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array) -> None:
        self.k, self.v, self.positions = k_cache, v_cache, positions
        self._rows = jnp.arange(positions.shape[0])

    def __call__(self, layer: int, half: int, q: jax.Array, k: jax.Array,
                 v: jax.Array) -> jax.Array:
        rows, pos = self._rows, self.positions
        self.k = self.k.at[layer, rows, pos].set(k.astype(self.k.dtype))
        self.v = self.v.at[layer, rows, pos].set(v.astype(self.v.dtype))
        return decode_attention(q, self.k[layer], self.v[layer], pos).reshape(q.shape)


def decoder_step(decoder: WeaveDecoder, hidden: jax.Array, positions: jax.Array,
                 k_cache: jax.Array, v_cache: jax.Array, *, schedule: str = "weave",
                 comm: str = "auto") -> tuple[jax.Array, jax.Array, jax.Array]:
    """The decoder stack on one token per cache row, reading and extending the cache: the one
    layer loop (``stack.run_stack``) with one half of ``B`` rows, :class:`CacheAttention` and
    the reducer of :func:`decode_impl` (the fused kernel's CTAs: the kernel policy's).

    ``hidden`` [B, H] replicated, ``positions`` int32 [B], caches [L, B, S, KVH, D] sharded over
    KVH. Returns the final-normed hidden [B, H] (replicated) and the updated caches.
    """
    impl = decode_impl(schedule, comm)
    factory = reducers.Psum if impl == "xla" else reducers.sharded(impl)
    ctx = decoder.context(POLICY_ENTRY)
    graphdef, state = nnx.split(decoder)

    def per_rank(state: Any, x: jax.Array, pos: jax.Array, kc: jax.Array,
                 vc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        attention = CacheAttention(kc, vc, pos)
        (h,) = run_stack(nnx.merge(graphdef, state), [x], [pos], factory(ctx), attention)
        return h, attention.k, attention.v

    kv_spec = cache_spec(decoder.axis_name)
    fn = jax.shard_map(per_rank, mesh=decoder.mesh,
                       in_specs=(partition_specs(decoder), P(), P(), kv_spec, kv_spec),
                       out_specs=(P(), kv_spec, kv_spec), check_vma=False)
    return fn(state, hidden, positions, k_cache, v_cache)
