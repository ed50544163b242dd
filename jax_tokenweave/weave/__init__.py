"""TokenWeave's policy: how a batch splits, and what follows each row-parallel GEMM.

- ``plan``: ``plan_batch(request_lengths, tp=, config=) -> BatchPlan``, the packed ragged
  layout, the split into two halves and the fused kernel's CTA counts;
- ``cost``: the halves' work model (GEMM + causal attention FLOPs), the balanced split point;
- ``tuning`` (+ ``tuning.json``): the one tuning table (threshold, offset, CTA counts);
- ``reducers``: what follows each row-parallel GEMM (``Psum``, ``Local``, ``Sharded``,
  ``LocalSharded``, ``Overlap``);
- ``schedules``: schedule and collective names, checks, and their configuration of the layer
  loop (``stack_setup``: halves + reducer + CTA counts).

Imports ``kernel`` and ``config`` only; ``nn`` runs what this decides.
"""
