"""Per-row token sampling and log-probabilities, jit-friendly (every setting a traced value).

Each row has its own ``temperature`` (0: greedy), ``top_k`` (0: all tokens), ``top_p`` and
random stream: the key of a row is ``fold_in(key(seed), counter)``, ``counter`` the number of
tokens its request has made, so a request's samples do not depend on what it is batched with.
:func:`sample` sorts the vocabulary; when every row is greedy, :func:`greedy` is the whole
choice (the engine picks one of the two on the host: no ``lax.cond`` on the device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy(logits: jax.Array) -> jax.Array:
    """The most likely token of each row of ``logits`` [S, V]: int32 [S]."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample(
    logits: jax.Array,
    seeds: jax.Array,
    counters: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
) -> jax.Array:
    """One token per row of ``logits`` [S, V]; the other arguments are [S]. Returns int32 [S].

    Sampling rows draw from ``softmax(logits / temperature)`` restricted to the ``top_k`` most
    likely tokens, then to the smallest set of those whose (renormalised) probability reaches
    ``top_p`` (the most likely token is always kept).
    """
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    k = jnp.asarray(top_k, jnp.int32)[:, None]
    in_top_k = (k <= 0) | (rank < k)
    probs = jax.nn.softmax(jnp.where(in_top_k, ranked, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass ranked above
    keep = in_top_k & (before < jnp.asarray(top_p, jnp.float32)[:, None])
    keep = keep.at[:, 0].set(True)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, ranked, -jnp.inf))
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature <= 0.0, greedy(logits), sampled)


def logprobs(
    logits: jax.Array, tokens: jax.Array, num_top: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of the model's distribution (``log_softmax(logits)``, no temperature):
    of ``tokens`` [S] -> [S], and the ``num_top`` largest -> values [S, K], ids int32 [S, K]."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    top, ids = jax.lax.top_k(lp, num_top)
    return chosen, top, ids.astype(jnp.int32)
