"""TokenWeave's policy: how a batch splits, and what follows each row-parallel GEMM.

``plan`` (``plan_batch -> BatchPlan``), ``cost`` (the balanced split), ``tuning`` (+
``tuning.json``), ``reducers`` (``Psum``, ``Local``, ``Sharded``, ``LocalSharded``,
``Overlap``), ``schedules`` (names, checks, ``stack_setup``). Imports ``kernel`` and
``config`` only; ``nn`` runs what this decides. See docs/WEAVE.md#weave.
"""
