"""Attention over the paged KV cache for a serving step, per rank: ``paged_attention``
(``PagedAttention``, the pure-JAX ``xla`` path, which implementation runs), ``attention_kernel``
(the CUDA kernels of ``ffi/attention/``, bound here), ``cudnn_attention`` (prompt tiles on
cuDNN) and ``paged_cache`` (the cache arrays). Imports nothing else of ``serving``. See
docs/SERVING.md#servingattention.
"""
