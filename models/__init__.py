"""Models built on ``WeaveDecoder`` (installed as ``jax_tokenweave.models``).

``configs``: named ``DecoderConfig``s (``get_config``); ``llama``: ``LlamaModel`` (Llama, Qwen2
and Mixtral shapes).
"""

from jax_tokenweave.models.configs import CONFIGS, config_names, get_config

__all__ = ["CONFIGS", "config_names", "get_config"]
