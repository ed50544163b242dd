"""Token sampling from logits: greedy, or temperature + nucleus (top-p), jit-friendly.

``temperature`` and ``top_p`` are traced scalars, so changing them does not recompile;
``temperature <= 0`` selects greedy (argmax) decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array | float = 0.0,
           top_p: jax.Array | float = 1.0) -> jax.Array:
    """Pick one token per row of ``logits`` [B, V]; returns int32 [B].

    Greedy where ``temperature <= 0``; else sample from ``softmax(logits / temperature)``
    restricted to the smallest set of most likely tokens whose probability reaches ``top_p``
    (the most likely token is always kept).
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs          # probability mass ranked above
    keep = before < top_p
    keep = keep.at[..., 0].set(True)
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    choice = jax.random.categorical(key, masked, axis=-1)
    sampled = jnp.take_along_axis(order, choice[..., None], axis=-1)[..., 0].astype(jnp.int32)
    return jnp.where(temperature <= 0.0, greedy, sampled)
