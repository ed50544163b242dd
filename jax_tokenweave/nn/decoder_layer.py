"""One Llama-style decoder layer: its sharded parameters and its per-rank compute pieces.

Params (global, ``[in, out]``): ``input_layernorm``, ``post_attention_layernorm`` [H];
``qkv_proj`` [H, (Nq+2Nkv)*D], ``gate_up_proj`` [H, 2F] ``P(None, "tp")`` (rank-blocked,
``nn.fused_layout``); ``o_proj`` [Nq*D, H], ``down_proj`` [F, H] ``P("tp", None)``; optional
``qkv_bias``, ``moe.*``. Methods are pure functions of per-rank arrays on the local shards
(inside ``shard_map``). Parameter table and Hugging Face names: docs/WEAVE.md#nndecoder_layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.kernel import ops
from jax_tokenweave.nn import attention as attn_lib
from jax_tokenweave.nn.moe import MoE
from jax_tokenweave.nn.params import ParamSpec, make_params


@functools.lru_cache(maxsize=64)
def inv_frequencies(config: DecoderConfig) -> np.ndarray:
    """RoPE inverse frequencies ``[head_dim // 2]`` (float64) of ``config``."""
    return attn_lib.rope_inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)


class DecoderLayer(nnx.Module):
    """One decoder layer (weights sharded as in the module docstring) and its per-rank pieces.

    ``x`` is always ``[T, H]`` replicated; partial sums are ``[T, H]`` per rank (their sum over
    the TP axis is the block's output).
    """

    # The parameters, set by name from ``make_params`` (module docstring); ``qkv_bias`` only
    # where ``config.qkv_bias``, ``gate_up_proj`` and ``down_proj`` only without experts,
    # ``moe`` only with them.
    input_layernorm: nnx.Param
    qkv_proj: nnx.Param
    qkv_bias: nnx.Param
    o_proj: nnx.Param
    post_attention_layernorm: nnx.Param
    gate_up_proj: nnx.Param
    down_proj: nnx.Param
    moe: MoE

    def __init__(
        self,
        config: DecoderConfig,
        mesh: Mesh,
        *,
        axis_name: str = "tp",
        dtype: jnp.dtype = jnp.bfloat16,
        rngs: nnx.Rngs,
    ) -> None:
        config.check_tensor_parallel(mesh.shape[axis_name])
        self.config = config
        h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
        nq, nkv = config.num_heads * d, config.num_kv_heads * d
        col, row, rep = P(None, axis_name), P(axis_name, None), P()
        specs: dict[str, ParamSpec] = {
            "input_layernorm": ((h,), rep, None),
            "qkv_proj": ((h, nq + 2 * nkv), col, 1 / np.sqrt(h)),
            "o_proj": ((nq, h), row, 1 / np.sqrt(nq)),
            "post_attention_layernorm": ((h,), rep, None),
        }
        if config.qkv_bias:
            specs["qkv_bias"] = ((nq + 2 * nkv,), P(axis_name), 0.5)
        if config.num_experts == 0:
            specs.update(
                gate_up_proj=((h, 2 * f), col, 1 / np.sqrt(h)),
                down_proj=((f, h), row, 1 / np.sqrt(f)),
            )
        for name, param in make_params(rngs, specs, dtype, mesh).items():
            setattr(self, name, param)
        if config.num_experts > 0:
            self.moe = MoE(config, mesh, axis_name=axis_name, dtype=dtype, rngs=rngs)

    # -- per-rank pieces ------------------------------------------------------------------
    def input_norm(self, x: jax.Array) -> jax.Array:
        """RMSNorm with ``input_layernorm`` (local, no communication): [T, H] -> [T, H]."""
        return ops.rms_norm(x, self.input_layernorm[...], self.config.rms_norm_eps)

    def qkv_heads(self, x_normed: jax.Array) -> tuple[jax.Array, int]:
        """The projection before RoPE: ``x_normed`` [T, H] -> ``(qkv [T, heads, D], nq)``,
        the local heads in the order q (``nq`` of them), k, v. One GEMM with the local
        ``qkv_proj`` block ``[q_r | k_r | v_r]``."""
        c = self.config
        qkv = jnp.dot(x_normed, self.qkv_proj[...])
        if c.qkv_bias:
            qkv = qkv + self.qkv_bias[...]
        heads = qkv.shape[-1] // c.head_dim  # local q + k + v heads
        nq = heads * c.num_heads // (c.num_heads + 2 * c.num_kv_heads)
        return qkv.reshape(qkv.shape[0], heads, c.head_dim), nq

    def qkv(
        self, x_normed: jax.Array, positions: jax.Array | np.ndarray
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Local heads: ``x_normed`` [T, H], ``positions`` [T] -> q [T, Nq/N, D],
        k, v [T, Nkv/N, D]; RoPE applied to q and k (:meth:`qkv_heads`, then RoPE)."""
        qkv, nq = self.qkv_heads(x_normed)
        nkv = (qkv.shape[1] - nq) // 2
        q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
        inv_freq = inv_frequencies(self.config)
        return (
            attn_lib.apply_rope(q, positions, inv_freq),
            attn_lib.apply_rope(k, positions, inv_freq),
            v,
        )

    def attention_out(self, attn: jax.Array) -> jax.Array:
        """Row-parallel output projection: [T, Nq/N, D] -> partial [T, H] (sum over ranks)."""
        return jnp.dot(attn.reshape(attn.shape[0], -1), self.o_proj[...])

    def mlp(self, x_normed: jax.Array) -> jax.Array:
        """SwiGLU (or MoE) on [T, H] replicated -> partial [T, H] (sum over ranks); one GEMM
        with the local ``gate_up_proj`` block ``[gate_r | up_r]``."""
        if self.config.num_experts > 0:
            return self.moe(x_normed)
        gate_up = jnp.dot(x_normed, self.gate_up_proj[...])
        f = gate_up.shape[-1] // 2
        return jnp.dot(jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:], self.down_proj[...])
