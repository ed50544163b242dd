"""Deprecated path, removed in 0.5.0: the module moved to ``jax_tokenweave.serving.offline.llm``."""

from jax_tokenweave._deprecation import moved_module

moved_module(__name__, "jax_tokenweave.serving.offline.llm")
