"""``WeaveDecoder``: the TP decoder stack (layers + final norm) in one ``jax.shard_map``.

``__call__(hidden [T, H], batch: BatchPlan, options=None, *, reducer=, **option fields)``
(``nn.forward.decoder_forward``) returns the final-normed [T, H], replicated;
``plan(request_lengths)`` plans a batch. Params:
``layers.{i}.<name>`` and ``final_norm`` [H], each with its ``PartitionSpec``. Half ``j`` uses
workspace slot ``j``. Parameter names and the overlapped program order: docs/WEAVE.md#nndecoder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.nn import forward as forward_lib
from jax_tokenweave.nn.decoder_layer import DecoderLayer
from jax_tokenweave.nn.forward import ForwardOptions, forward_options
from jax_tokenweave.nn.params import load_weights, make_param
from jax_tokenweave.nn.prefill import PrefillAttention
from jax_tokenweave.weave.plan import BatchPlan, plan_batch
from jax_tokenweave.weave.reducers import ReduceContext
from jax_tokenweave.weave.schedules import ReducerFactory
from jax_tokenweave.weave.tuning import DEFAULT_ENTRY, TuneEntry

__all__ = ["WeaveDecoder"]


class WeaveDecoder(nnx.Module):
    """``config.num_layers`` ``DecoderLayer``s and the final norm, run inside one ``shard_map``.

    Args:
      config: model shapes; every sharded dimension must divide by the mesh axis size.
      mesh: a mesh with the tensor-parallel axis ``axis_name``.
      dtype: parameter and activation dtype.
      rngs: ``nnx.Rngs`` for the random initial weights.
    """

    def __init__(
        self,
        config: DecoderConfig,
        mesh: Mesh,
        *,
        axis_name: str = "tp",
        dtype: jnp.dtype = jnp.bfloat16,
        rngs: nnx.Rngs,
    ) -> None:
        config.check_mesh(mesh, axis_name)
        self.config = config
        self.mesh = mesh
        self.axis_name = axis_name
        self.dtype = jnp.dtype(dtype)
        self.layers = nnx.List(
            [
                DecoderLayer(config, mesh, axis_name=axis_name, dtype=dtype, rngs=rngs)
                for _ in range(config.num_layers)
            ]
        )
        self.final_norm = make_param(rngs, (config.hidden_size,), dtype, mesh, P(), None)

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (size of ``axis_name``)."""
        return self.mesh.shape[self.axis_name]

    def load_weights(self, weights: Mapping[str, Any], *, strict: bool = True) -> None:
        """Set weights from full arrays named as ``params.named_params`` (see ``load_weights``)."""
        load_weights(self, self.mesh, weights, strict=strict)

    def plan(self, request_lengths: Sequence[int], **kwargs: Any) -> BatchPlan:
        """``weave.plan.plan_batch`` for this decoder: its TP degree and config (so the shipped
        tuning table's rows for its shapes, and the work-balance split rule); ``kwargs`` as
        ``plan_batch`` takes them (``split=``, ``threshold=``, ``offset=``, ``table=`` ...)."""
        return plan_batch(request_lengths, tp=self.tp, config=self.config, **kwargs)

    def context(self, tuning: TuneEntry = DEFAULT_ENTRY) -> ReduceContext:
        """The reducers' context of this decoder (axis, mesh, eps) with ``tuning``'s CTAs."""
        return ReduceContext(self.axis_name, self.mesh, self.config.rms_norm_eps, tuning)

    def __call__(
        self,
        hidden: jax.Array,
        batch: BatchPlan,
        options: ForwardOptions | None = None,
        *,
        return_kv: bool = False,
        reducer: ReducerFactory | None = None,
        **overrides: Any,
    ) -> Any:
        """Run the stack on ``hidden`` [T, H] (replicated) laid out as ``batch``
        (``nn.forward.decoder_forward`` with a ``PrefillAttention``).

        ``options`` (default ``ForwardOptions()``) with ``overrides``, its fields by keyword
        (``schedule=``, ``collective=``, ``tuning=`` ...). Returns the final-normed [T, H],
        replicated; with ``return_kv`` also per layer ``(k, v)`` [T, Nkv, D] sharded over heads,
        RoPE applied to k. ``nocomm`` and ``collective="local"`` do NOT compute the model.
        ``reducer``: a reducer factory replacing the schedule's (tests, experiments).
        ``collective="ffi"`` where the kernel cannot run raises ``RuntimeError`` saying why.
        """
        options = forward_options(options, overrides)
        attention = PrefillAttention(keep_kv=return_kv, num_layers=self.config.num_layers)
        out, kv = forward_lib.decoder_forward(
            self, hidden, batch, attention, options, reducer=reducer
        )
        return (out, kv) if return_kv else out
