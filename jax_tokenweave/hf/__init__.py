"""Hugging Face checkpoints: ``config.json`` mapping, per-device safetensors reads, loading.

``hf.config`` (``load_hf_config``, ``decoder_config_from_hf``), ``hf.reader``
(``load_sharded``: each device reads its block), ``hf.loading`` (``load_pretrained``),
``hf.errors`` (``CheckpointError``, ``UnsupportedConfigError``). To load by ``model_type``,
use ``jax_tokenweave.from_pretrained``. See docs/PACKAGE.md#hf.
"""

from jax_tokenweave.hf.config import (
    SUPPORTED_MODEL_TYPES,
    HFModelInfo,
    decoder_config_from_hf,
    load_hf_config,
    read_json,
)
from jax_tokenweave.hf.errors import CheckpointError, UnsupportedConfigError
from jax_tokenweave.hf.loading import (
    check_checkpoint,
    fused_sources,
    hf_sources,
    load_pretrained,
)
from jax_tokenweave.hf.reader import (
    INDEX_FILE,
    SINGLE_FILE,
    Fused,
    SafetensorsCheckpoint,
    Source,
    TensorInfo,
    check_source,
    load_sharded,
)

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "SUPPORTED_MODEL_TYPES",
    "CheckpointError",
    "Fused",
    "HFModelInfo",
    "SafetensorsCheckpoint",
    "Source",
    "TensorInfo",
    "UnsupportedConfigError",
    "check_checkpoint",
    "check_source",
    "decoder_config_from_hf",
    "fused_sources",
    "hf_sources",
    "load_hf_config",
    "load_pretrained",
    "load_sharded",
    "read_json",
]
