"""How ``LLM(...)`` (``serving.offline.llm``) turns its arguments into what it serves: the checks
made before anything loads, the model (from a checkpoint directory or Hugging Face id, on a mesh of
the first ``tensor_parallel_size`` devices), the tokenizer and the ``EngineConfig`` (the KV
cache sized to the memory). What is derived from the checkpoint (dtype, ``max_model_len``, the
cache's blocks) is ``serving.offline.resolve``'s.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jax_tokenweave.serving import checks
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.offline import resolve
from jax_tokenweave.serving.runner import memory
from jax_tokenweave.serving.sampling import processors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
"""The keywords ``LLM(**engine)`` takes: ``EngineConfig``'s fields (and :data:`VLLM_ALIASES`)."""
VLLM_ALIASES = {"num_gpu_blocks_override": "num_blocks"}
"""vLLM's names of ``EngineConfig`` fields that ``LLM`` accepts too (None: not given)."""


def vllm_aliases(engine: dict[str, Any]) -> dict[str, Any]:
    """``engine`` with :data:`VLLM_ALIASES` renamed to their fields; ``ValueError`` where an
    alias and its field are both given and differ."""
    out = dict(engine)
    for alias, field in VLLM_ALIASES.items():
        value = out.pop(alias, None)
        if value is None:
            continue
        if out.get(field, value) != value:
            raise ValueError(
                f"LLM {alias}={value!r} and {field}={out[field]!r} disagree "
                f"({alias} is vLLM's name of {field})"
            )
        out[field] = value
    return out


def load_tokenizer(path: str | os.PathLike) -> Any:
    """``transformers.AutoTokenizer`` of a checkpoint directory; None where it has no tokenizer
    files (then prompts and outputs are token ids only)."""
    if not any((Path(path) / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def check_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` if it can encode and decode (``ValueError`` naming ``tokenizer`` else)."""
    if not all(callable(getattr(tokenizer, m, None)) for m in ("encode", "decode")):
        raise ValueError(
            f"LLM tokenizer must be a tokenizer (with encode and decode), a "
            f"directory, None or False; got {type(tokenizer).__name__}"
        )
    return tokenizer


def make_mesh(mesh: Mesh | None, tp: int | None, axis_name: str = "tp") -> Mesh:
    """``mesh`` as given, or a 1-D ``axis_name`` mesh over the first ``tp`` devices (default 1)."""
    if mesh is not None:
        if tp is not None and mesh.shape.get(axis_name) != tp:
            raise ValueError(
                f"tp={tp} disagrees with the mesh's {axis_name!r} axis ({dict(mesh.shape)})"
            )
        return mesh
    tp = 1 if tp is None else checks.at_least(tp, 1, "tensor_parallel_size")
    devices = jax.devices()
    if len(devices) < tp:
        hint = (
            f"; on a CPU-only host set JAX_NUM_CPU_DEVICES={tp} (or XLA_FLAGS="
            f"--xla_force_host_platform_device_count={tp}) before JAX starts"
            if devices[0].platform == "cpu"
            else ""
        )
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices, have {len(devices)}{hint}")
    return Mesh(np.array(devices[:tp]), (axis_name,))


def check_model(model: Any) -> None:
    """``model`` must be a checkpoint path or id (a non-empty string) or a model object
    (``TypeError`` naming ``model`` else)."""
    if isinstance(model, str | os.PathLike):
        if not os.fspath(model):
            raise ValueError("LLM model is an empty string: give a checkpoint directory or id")
        return
    checks.model_object(
        model,
        "LLM model",
        "a checkpoint directory, a Hugging Face model id (str) or a model "
        "(models.llama.LlamaModel)",
    )


def tokenizer_source(tokenizer: Any) -> Any:
    """``tokenizer`` as ``LLM`` takes it, with a path resolved to a directory holding tokenizer
    files (a directory, or a Hugging Face id in the local cache); ``ValueError`` naming
    ``tokenizer`` where there is none (checked before the weights load)."""
    if not isinstance(tokenizer, str | os.PathLike):
        return tokenizer
    try:
        path = resolve.checkpoint_dir(tokenizer)
    except ValueError as err:
        raise ValueError(f"LLM tokenizer={os.fspath(tokenizer)!r}: {err}") from None
    if not any((Path(path) / name).exists() for name in TOKENIZER_FILES):
        raise ValueError(
            f"LLM tokenizer={os.fspath(tokenizer)!r}: {path} holds no tokenizer files "
            f"({', '.join(TOKENIZER_FILES)})"
        )
    return path


def check_arguments(
    model: Any,
    engine: dict[str, Any],
    config: EngineConfig | None,
    tp: int | None,
    tensor_parallel_size: int | None,
    gpu_memory_utilization: float,
    tokenizer: Any,
) -> int | None:
    """The checks of ``LLM``'s arguments before anything loads: ``TypeError`` for a keyword
    that is not an ``EngineConfig`` field, ``ValueError`` naming the argument else. Returns the
    tensor-parallel size (``tp`` is its alias; None where neither is given)."""
    check_model(model)
    unknown = sorted(set(engine) - ENGINE_FIELDS)
    if unknown:
        raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
    if config is not None and not isinstance(config, EngineConfig):
        raise ValueError(f"LLM config must be an EngineConfig, got {type(config).__name__}")
    if tp is not None and tensor_parallel_size is not None and tp != tensor_parallel_size:
        raise ValueError(
            f"LLM tp={tp} and tensor_parallel_size={tensor_parallel_size} disagree (tp is an alias)"
        )
    resolve.check_utilization(gpu_memory_utilization)
    if (
        tokenizer is not None
        and tokenizer is not False
        and not isinstance(tokenizer, str | os.PathLike)
    ):
        check_tokenizer(tokenizer)
    return tensor_parallel_size if tensor_parallel_size is not None else tp


def load_model(model: Any, mesh: Mesh | None, tp: int | None, dtype: Any) -> tuple[Any, str | None]:
    """``(model, its checkpoint directory)``: a checkpoint directory or Hugging Face id loaded
    (``models.auto.from_pretrained``) onto ``mesh`` or the first ``tp`` devices in ``dtype``
    (``"auto"``: the checkpoint's); a model as given (directory None), which brings its own
    mesh and dtype (``ValueError`` where ``tp``, ``mesh`` or ``dtype`` is given with it)."""
    if isinstance(model, str | os.PathLike):
        from jax_tokenweave.hf.config import load_hf_config
        from jax_tokenweave.models.auto import from_pretrained

        source = resolve.checkpoint_dir(model)
        info = load_hf_config(source)
        return (
            from_pretrained(
                source, make_mesh(mesh, tp), resolve.param_dtype(dtype, info.torch_dtype)
            ),
            source,
        )
    if tp is not None or mesh is not None:
        raise ValueError(
            "tensor_parallel_size and mesh apply to a checkpoint; a model brings its own mesh"
        )
    if dtype != "auto":
        raise ValueError("dtype applies to a checkpoint; a model has its own")
    return model, None


def resolve_tokenizer(tokenizer: Any, source: str | None) -> Any:
    """The tokenizer to serve with: ``tokenizer`` as given, loaded from it where it is a
    directory, the checkpoint's (``source``) where it is None; None for none (False, or no
    tokenizer files)."""
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = load_tokenizer(tokenizer)
    elif tokenizer is None and source is not None:
        tokenizer = load_tokenizer(source)
    return tokenizer or None


def engine_config(
    model: Any,
    config: EngineConfig | None,
    engine: dict[str, Any],
    max_model_len: int | None,
    seed: int | None,
    utilization: float,
) -> EngineConfig:
    """``config`` with the ``engine`` keywords on top, ``max_model_len`` checked against the
    checkpoint's limit, ``seed``, and ``num_blocks`` (unless given) sized to ``utilization``
    of the model's devices' memory (``serving.offline.resolve``)."""
    fields = {**(config.__dict__ if config is not None else {}), **engine}
    info = getattr(model, "hf_info", None)
    limit = None if info is None else info.max_position_embeddings
    fields["max_model_len"] = resolve.model_len(
        max_model_len if max_model_len is not None else fields.get("max_model_len"),
        limit,
        EngineConfig.max_model_len,
    )
    if seed is not None:
        fields["seed"] = checks.at_least(seed, 0, "LLM seed")
    if "num_blocks" not in fields:
        probe = EngineConfig(**fields)
        devices = list(model.mesh.devices.flat)
        fields["num_blocks"] = resolve.cache_blocks(
            devices,
            model.config,
            probe,
            model.embed.get_value().dtype,
            utilization,
            memory.device_stats(devices),
            processors.state_bytes(
                probe.max_num_seqs, model.config.vocab_size, probe.max_biased_tokens
            ),
        )
    return EngineConfig(**fields)
