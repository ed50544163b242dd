"""The tensor-parallel decoder: its weights, its per-rank pieces and the layer loop.

- ``decoder``: ``WeaveDecoder``, the nnx.Module of the stack (layers + final norm) run inside
  one ``shard_map`` under a schedule;
- ``stack``: ``run_stack``, the one layer loop (layers x stages x halves, a reducer of
  ``weave.reducers`` after each row-parallel GEMM); ``PrefillAttention``;
- ``decoder_layer``: ``DecoderLayer``, one layer's weights and per-rank compute pieces;
- ``attention``: RoPE and ragged causal attention (prefix K/V of a request cut by the split);
- ``moe``: the Mixtral-style MoE MLP;
- ``params``: sharded ``nnx.Param``s with Flax sharding metadata; names, specs, loading;
- ``fused_layout``: the rank-blocked layout of the fused projections (``qkv_proj``,
  ``gate_up_proj``): a weight layout, not the fused kernel.

Imports ``kernel``, ``weave`` and ``config``; ``models`` build on ``WeaveDecoder``.
"""
