"""Deprecated old path of ``jax_tokenweave.nn.moe`` (removed in 0.4.0)."""

from jax_tokenweave._legacy import moved_module

moved_module(__name__)
