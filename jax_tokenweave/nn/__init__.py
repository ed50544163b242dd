"""The tensor-parallel decoder: its weights, its per-rank pieces and the layer loop.

``decoder`` (``WeaveDecoder``), ``forward`` (``decoder_forward``, ``ForwardOptions``), ``stack``
(``run_stack``), ``prefill``, ``decoder_layer``, ``attention``, ``moe``, ``params``,
``fused_layout``. Imports ``kernel``, ``weave`` and ``config``;
``models`` build on ``WeaveDecoder``. The modules' roles: docs/WEAVE.md#nn.
"""
