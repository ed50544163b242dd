"""Mixtral-style sparse MoE MLP, tensor-parallel over each expert's FFN dimension.

Params: ``router`` [H, E] replicated, ``gate_up_proj`` [E, H, 2F] ``P(None, None, "tp")``
(rank-blocked fused), ``down_proj`` [E, F, H] ``P(None, "tp", None)``. Top-``k`` routing in
float32; dense dispatch (every expert on every token: ``E / k`` the FLOPs of a sparse one, an
``[T, E, F/tp]`` activation). Output: a per-rank partial sum, like the dense MLP's.
Parameter table, routing and dispatch: docs/WEAVE.md#nnmoe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.nn.params import make_params


def router_weights(x: jax.Array, router: jax.Array, top_k: int) -> jax.Array:
    """Dense combine weights ``[T, E]`` float32: softmax over each token's top-k logits, else 0.

    ``x``: [T, H]; ``router``: [H, E].
    """
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
    top_values, top_index = jax.lax.top_k(logits, top_k)
    top_weights = jax.nn.softmax(top_values, axis=-1)
    one_hot = jax.nn.one_hot(top_index, logits.shape[-1], dtype=jnp.float32)  # [T, k, E]
    return jnp.einsum("tk,tke->te", top_weights, one_hot)


def moe_partial(
    x: jax.Array, router: jax.Array, gate_up: jax.Array, down: jax.Array, top_k: int
) -> jax.Array:
    """Per-rank partial MoE output ``[T, H]`` (sum over ranks = the MoE output).

    ``x``: [T, H] replicated; ``gate_up``: [E, H, 2F/tp] (this rank's ``[gate | up]``);
    ``down``: [E, F/tp, H] (local).
    """
    weights = router_weights(x, router, top_k).astype(x.dtype)  # [T, E]
    gate_up = jnp.einsum("th,ehf->tef", x, gate_up)
    f = gate_up.shape[-1] // 2
    h = jax.nn.silu(gate_up[..., :f]) * gate_up[..., f:] * weights[:, :, None]
    return jnp.einsum("tef,efh->th", h, down)


class MoE(nnx.Module):
    """Router (replicated) and ``E`` SwiGLU experts with their FFN dimension sharded over TP."""

    def __init__(
        self,
        config: DecoderConfig,
        mesh: Mesh,
        *,
        axis_name: str = "tp",
        dtype: jnp.dtype = jnp.bfloat16,
        rngs: nnx.Rngs,
    ) -> None:
        e, h, f = config.num_experts, config.hidden_size, config.intermediate_size
        if e <= 0:
            raise ValueError(f"MoE needs config.num_experts > 0, got {e}")
        self.top_k = config.experts_per_token
        params = make_params(
            rngs,
            {
                "router": ((h, e), P(), 1 / np.sqrt(h)),
                "gate_up_proj": ((e, h, 2 * f), P(None, None, axis_name), 1 / np.sqrt(h)),
                "down_proj": ((e, f, h), P(None, axis_name, None), 1 / np.sqrt(f)),
            },
            dtype,
            mesh,
        )
        self.router = params["router"]
        self.gate_up_proj = params["gate_up_proj"]
        self.down_proj = params["down_proj"]

    def __call__(self, x: jax.Array) -> jax.Array:
        """Per rank (inside ``shard_map``): ``x`` [T, H] replicated -> partial [T, H]."""
        return moe_partial(
            x, self.router[...], self.gate_up_proj[...], self.down_proj[...], self.top_k
        )


def reference_moe(
    x: np.ndarray,
    router: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    down: np.ndarray,
    top_k: int,
) -> np.ndarray:
    """Float64 NumPy MoE on full (unsharded) weights, sparse dispatch: [T, H] -> [T, H]."""
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(router, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-logits[t], kind="stable")[:top_k]
        w = np.exp(logits[t, top] - logits[t, top].max())
        w /= w.sum()
        for weight, e in zip(w, top, strict=True):
            g = x[t] @ np.asarray(gate[e], np.float64)
            u = x[t] @ np.asarray(up[e], np.float64)
            out[t] += weight * ((g / (1 + np.exp(-g)) * u) @ np.asarray(down[e], np.float64))
    return out
