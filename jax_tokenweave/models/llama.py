"""``LlamaModel``: token embedding -> ``WeaveDecoder`` (incl. final norm) -> LM head.

Llama 3, Qwen2 (``qkv_bias``) and Mixtral (``num_experts``) shapes. ``embed`` [V, H]
``P("tp", None)`` (vocab-sharded: ``vocab_size`` must divide by TP), ``lm_head`` [H, V]
``P(None, "tp")`` (``embed.T`` when tied). Logits: float32 [T, V], replicated; token ids
outside ``[0, V)`` embed to zeros. Parameter table: docs/PACKAGE.md#modelsllama.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.hf.loading import load_pretrained
from jax_tokenweave.nn.decoder import WeaveDecoder
from jax_tokenweave.nn.forward import ForwardOptions
from jax_tokenweave.nn.params import load_weights, make_param, numpy_weights
from jax_tokenweave.weave.plan import BatchPlan


class LlamaModel(nnx.Module):
    """Embedding, TP decoder stack and LM head over the mesh axis ``axis_name`` (size N)."""

    def __init__(
        self,
        config: DecoderConfig,
        mesh: Mesh,
        *,
        axis_name: str = "tp",
        dtype: jnp.dtype = jnp.bfloat16,
        rngs: nnx.Rngs,
    ) -> None:
        tp = config.check_mesh(mesh, axis_name)
        if config.vocab_size % tp:
            raise ValueError(
                f"vocab_size={config.vocab_size} is not divisible by the "
                f"tensor-parallel degree {tp} (the embedding is vocab-sharded)"
            )
        self.config = config
        self.mesh = mesh
        self.axis_name = axis_name
        h, v = config.hidden_size, config.vocab_size
        self.embed = make_param(rngs, (v, h), dtype, mesh, P(axis_name, None), 1.0)
        self.decoder = WeaveDecoder(config, mesh, axis_name=axis_name, dtype=dtype, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = make_param(rngs, (h, v), dtype, mesh, P(None, axis_name), 1 / np.sqrt(h))

    @classmethod
    def from_pretrained(
        cls, path: str, mesh: Mesh, dtype: Any = None, *, axis_name: str = "tp"
    ) -> Any:
        """This class with the weights of the Hugging Face checkpoint directory ``path``, each
        device reading only its shards (``jax_tokenweave.hf.loading.load_pretrained``; ``dtype``
        floating point, default bfloat16). ``jax_tokenweave.from_pretrained`` picks the class
        from the checkpoint's ``model_type`` instead."""
        return load_pretrained(cls, path, mesh, dtype, axis_name=axis_name)

    def load_weights(self, weights: Mapping[str, Any], *, strict: bool = True) -> None:
        """Set weights from full arrays by name (module docstring); see ``params.load_weights``."""
        load_weights(self, self.mesh, weights, strict=strict)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """``tokens`` int [T] -> hidden [T, H] replicated (vocab-sharded lookup + psum)."""
        axis, rows = self.axis_name, self.config.vocab_size // self.mesh.shape[self.axis_name]

        def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
            local = ids - jax.lax.axis_index(axis) * rows
            valid = (local >= 0) & (local < rows)
            found = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0)
            return jax.lax.psum(jnp.where(valid[:, None], found, 0).astype(table.dtype), axis)

        return jax.shard_map(
            lookup, mesh=self.mesh, in_specs=(P(axis, None), P()), out_specs=P(), check_vma=False
        )(self.embed[...], tokens)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final-normed hidden [T, H] replicated -> float32 logits [T, V] replicated."""
        axis = self.axis_name
        if self.config.tie_word_embeddings:
            head, spec, pattern = self.embed[...], P(axis, None), "th,vh->tv"
        else:
            head, spec, pattern = self.lm_head[...], P(None, axis), "th,hv->tv"

        def project(h: jax.Array, w: jax.Array) -> jax.Array:
            local = jnp.einsum(pattern, h, w, preferred_element_type=jnp.float32)
            return jax.lax.all_gather(local, axis, axis=1, tiled=True)

        return jax.shard_map(
            project, mesh=self.mesh, in_specs=(P(), spec), out_specs=P(), check_vma=False
        )(hidden, head)

    def __call__(
        self,
        tokens: jax.Array,
        batch: BatchPlan,
        options: ForwardOptions | None = None,
        *,
        return_kv: bool = False,
        **overrides: Any,
    ) -> Any:
        """``tokens`` int [T] packed as ``batch`` -> float32 logits [T, V] replicated.

        ``options`` and ``overrides`` (its fields by keyword: ``schedule=``, ``collective=``
        ...) as ``WeaveDecoder.__call__`` takes them; with ``return_kv`` also the decoder's
        per-layer ``(k, v)``. ``schedule="nocomm"`` removes the decoder's collectives: its
        logits are not the model's.
        """
        shape = tuple(getattr(tokens, "shape", ()))
        if len(shape) != 1:
            raise ValueError(f"tokens must be a 1-D array [T], got shape {shape}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be integers, got {tokens.dtype}")
        if not isinstance(batch, BatchPlan):
            raise ValueError(f"batch must be a BatchPlan (see plan_batch), got {type(batch)}")
        if shape[0] != batch.num_tokens:
            raise ValueError(
                f"got {shape[0]} tokens but the batch's request lengths sum to {batch.num_tokens}"
            )
        hidden = self.embed_tokens(tokens.astype(jnp.int32))
        out = self.decoder(hidden, batch, options, return_kv=return_kv, **overrides)
        if return_kv:
            return self.logits(out[0]), out[1]
        return self.logits(out)

    def numpy_weights(self) -> dict[str, np.ndarray]:
        """All weights as full NumPy arrays by name (gathers the shards)."""
        return numpy_weights(self)
