"""Hugging Face checkpoints: ``config.json`` -> ``DecoderConfig``, and per-rank safetensors reads.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or sharded
``model-0000i-of-0000n.safetensors`` files with ``model.safetensors.index.json`` (tensor name ->
file). Supported ``model_type``: ``llama``, ``mistral`` (Llama layout), ``qwen2`` (qkv bias) and
``mixtral`` (sparse MoE).

Reading: :func:`load_sharded` builds a ``jax.Array`` with ``jax.make_array_from_callback`` and a
``NamedSharding``; the callback runs once per addressable device with that device's slice of the
global shape and reads only that slice from the file (a ``numpy.memmap`` of the tensor's bytes),
so no host ever materialises a full copy of a sharded tensor. (The safetensors package's numpy
``get_slice`` cannot return bfloat16, the dtype of most real checkpoints, hence the small reader
here; the file format is an 8-byte little-endian header length, a JSON header, then raw bytes.)

Hugging Face linear weights are ``[out, in]``; :class:`Source` with ``transpose=True`` yields the
``[in, out]`` layout, slicing the file in the transposed order so a column-parallel weight's shard
is a block of rows of the stored tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_tokenweave.config import DecoderConfig, RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}


class CheckpointError(ValueError):
    """A checkpoint directory or file is missing, truncated, or does not fit the model."""


class UnsupportedConfigError(ValueError):
    """``config.json`` describes a model or feature this library does not implement."""


# --------------------------------------------------------------------------------------------
# config.json -> DecoderConfig
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HFModelInfo:
    """What ``config.json`` (and ``generation_config.json``, if present) say about a model."""

    model_type: str
    config: DecoderConfig
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    torch_dtype: str | None


def read_json(path: str) -> dict[str, Any]:
    """Parse a JSON file, raising :class:`CheckpointError` if it is missing or malformed."""
    if not os.path.isfile(path):
        raise CheckpointError(f"missing file: {path}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def load_hf_config(path: str) -> HFModelInfo:
    """Read ``path/config.json`` (+ ``generation_config.json``) into an :class:`HFModelInfo`."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory does not exist: {path}")
    raw = read_json(os.path.join(path, "config.json"))
    gen_path = os.path.join(path, "generation_config.json")
    gen = read_json(gen_path) if os.path.isfile(gen_path) else {}
    eos = gen.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return HFModelInfo(
        model_type=raw.get("model_type", ""),
        config=decoder_config_from_hf(raw),
        eos_token_ids=eos_ids,
        bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id")),
        pad_token_id=gen.get("pad_token_id", raw.get("pad_token_id")),
        torch_dtype=raw.get("dtype", raw.get("torch_dtype")),
    )


def decoder_config_from_hf(raw: Mapping[str, Any]) -> DecoderConfig:
    """Map a Hugging Face ``config.json`` dict to a :class:`DecoderConfig`.

    Raises :class:`UnsupportedConfigError` for a model type or feature not implemented here
    (other activations, attention output / MLP biases, RoPE scaling other than ``llama3``);
    warns that a sliding window, where one is set, is ignored (full causal attention is used).
    """
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError(
            f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise UnsupportedConfigError(f"config.json ({model_type}) lacks required key {key!r}")
        return raw[key]

    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
    if raw.get("mlp_bias"):
        raise UnsupportedConfigError("mlp_bias=True is not supported")
    qkv_bias = model_type == "qwen2"
    if model_type in ("llama", "mistral") and raw.get("attention_bias"):
        raise UnsupportedConfigError(
            "attention_bias=True (a bias on q/k/v *and* o_proj) is not supported")
    _warn_sliding_window(raw, model_type)

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    head_dim = raw.get("head_dim") or hidden // heads
    theta, scaling = _rope(raw)
    num_experts = int(need("num_local_experts")) if model_type == "mixtral" else 0
    extra = {"experts_per_token": int(need("num_experts_per_tok"))} if num_experts else {}
    try:
        return DecoderConfig(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            num_experts=num_experts,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            **extra,
        )
    except ValueError as e:
        raise UnsupportedConfigError(f"config.json describes an invalid model: {e}") from e


def _rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, RopeScaling | None)`` from ``rope_parameters`` (transformers >= 5) or the
    older top-level ``rope_theta`` + ``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise UnsupportedConfigError(
            f"rope scaling type {rope_type!r} is not supported (only 'default' and 'llama3')")
    try:
        return float(theta), RopeScaling(
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise UnsupportedConfigError(f"llama3 rope scaling lacks key {e}") from e


def _warn_sliding_window(raw: Mapping[str, Any], model_type: str) -> None:
    window = raw.get("sliding_window")
    if model_type == "qwen2":
        active = bool(raw.get("use_sliding_window")) and window is not None
    else:
        active = window is not None
    if active:
        warnings.warn(
            f"{model_type}: sliding_window={window} is ignored; full causal attention is used "
            f"(identical for sequences no longer than the window)", stacklevel=3)


# --------------------------------------------------------------------------------------------
# safetensors files
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype, shape and byte offset of its data in the file."""

    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int


def _read_header(path: str) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header, checking that every tensor's bytes are present."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file (header of {n} bytes, file of {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from e
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        dtype = _DTYPES[meta["dtype"]]
        shape = tuple(int(d) for d in meta["shape"])
        begin, end = meta["data_offsets"]
        if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(f"{path}: tensor {name}'s byte range does not match its shape")
        if 8 + n + end > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name} needs bytes up to "
                f"{8 + n + end}, the file has {size}")
        out[name] = TensorInfo(path, dtype, shape, 8 + n + begin)
    return out


class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory (single file or sharded with an index).

    Opening reads only headers; :meth:`read` reads a slice of one tensor from its file.
    """

    def __init__(self, path: str):
        self.path = path
        index_path = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index_path):
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path} has no 'weight_map'")
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise CheckpointError(
                f"{path}: no safetensors weights ({INDEX_FILE} or {SINGLE_FILE}) found")
        self.tensors: dict[str, TensorInfo] = {}
        for name in files:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise CheckpointError(f"missing shard file {file} (listed in {INDEX_FILE})")
            self.tensors.update(_read_header(file))
        if weight_map is not None:
            absent = [k for k, f in weight_map.items()
                      if k not in self.tensors or os.path.basename(self.tensors[k].file) != f]
            if absent:
                raise CheckpointError(
                    f"{path}: tensors listed in {INDEX_FILE} are missing from their files: "
                    f"{_few(absent)}")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        """The :class:`TensorInfo` of ``name``; :class:`CheckpointError` if absent."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: checkpoint has no tensor {name!r}")
        return self.tensors[name]

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """Read ``tensor[index]`` (basic slices) as a new array; only those bytes are copied."""
        info = self.info(name)
        mm = np.memmap(info.file, dtype=info.dtype, mode="r", offset=info.offset,
                       shape=info.shape)
        return np.array(mm[index])


def _few(names: Sequence[str], n: int = 5) -> str:
    more = f" (and {len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


# --------------------------------------------------------------------------------------------
# sharded reads
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Source:
    """How a target array is made from checkpoint tensors.

    ``names``: one name, or a tuple of names stacked along a new leading axis (e.g. the experts
    of a MoE layer). ``transpose``: reverse the last two axes of each stored tensor (HF
    ``[out, in]`` -> ``[in, out]``). ``shape``: the stored shape each name must have.
    """

    names: str | tuple[str, ...]
    shape: tuple[int, ...]
    transpose: bool = False

    @property
    def stacked(self) -> bool:
        return isinstance(self.names, tuple)

    def target_shape(self) -> tuple[int, ...]:
        shape = self.shape[:-2] + self.shape[-2:][::-1] if self.transpose else self.shape
        return (len(self.names), *shape) if self.stacked else shape


def check_source(ckpt: SafetensorsCheckpoint, src: Source) -> None:
    """Raise :class:`CheckpointError` unless every tensor of ``src`` exists with its shape."""
    names = src.names if src.stacked else (src.names,)
    missing = [n for n in names if n not in ckpt]
    if missing:
        raise CheckpointError(f"{ckpt.path}: missing tensors: {_few(missing)}")
    for n in names:
        got = ckpt.info(n).shape
        if got != src.shape:
            raise CheckpointError(
                f"{ckpt.path}: tensor {n!r} has shape {got}, the config implies {src.shape}")


def _read_target_slice(ckpt: SafetensorsCheckpoint, src: Source,
                       index: tuple[slice, ...]) -> np.ndarray:
    """The block ``target[index]`` of the target array described by ``src``."""
    index = tuple(index) + (slice(None),) * (len(src.target_shape()) - len(index))
    if src.stacked:
        picks = range(len(src.names))[index[0]]
        return np.stack([_read_target_slice(ckpt, Source(src.names[i], src.shape, src.transpose),
                                            index[1:]) for i in picks])
    if src.transpose:
        stored = (*index[:-2], index[-1], index[-2])
        block = ckpt.read(src.names, stored)
        return np.swapaxes(block, -1, -2)
    return ckpt.read(src.names, index)


def load_sharded(ckpt: SafetensorsCheckpoint, src: Source, mesh: Mesh, spec: PartitionSpec,
                 dtype: Any) -> jax.Array:
    """A ``jax.Array`` of ``src.target_shape()`` sharded as ``NamedSharding(mesh, spec)``.

    Each addressable device's callback reads only its own block from the file (devices with the
    same block, e.g. replicas, share one read). The result is cast to ``dtype`` on the host.
    """
    check_source(ckpt, src)
    shape = src.target_shape()
    sharding = NamedSharding(mesh, spec)
    cache: dict[tuple, np.ndarray] = {}

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            cache[key] = np.ascontiguousarray(
                _read_target_slice(ckpt, src, index).astype(dtype, copy=False))
        return cache[key]

    return jax.make_array_from_callback(shape, sharding, callback)


def load_all(ckpt: SafetensorsCheckpoint, plan: Mapping[str, tuple[Source, PartitionSpec]],
             mesh: Mesh, dtype: Any,
             on_array: Callable[[str, jax.Array], None] | None = None) -> dict[str, jax.Array]:
    """Check every source of ``plan`` first (so a bad checkpoint fails before any read), then
    load each with :func:`load_sharded`; ``on_array(key, array)`` is called as each arrives."""
    for src, _ in plan.values():
        check_source(ckpt, src)
    out = {}
    for key, (src, spec) in plan.items():
        out[key] = load_sharded(ckpt, src, mesh, spec, dtype)
        if on_array is not None:
            on_array(key, out[key])
    return out


# --------------------------------------------------------------------------------------------
# name mapping and model loading
# --------------------------------------------------------------------------------------------

def hf_sources(config: DecoderConfig) -> dict[str, Source]:
    """``{parameter name of LlamaModel: Source}`` for a Hugging Face Llama/Qwen2/Mixtral layout.

    The stored shapes follow from ``config`` (HF ``[out, in]`` linears, transposed on load);
    MoE experts ``experts.{e}.w1/w3/w2`` are stacked into ``[E, ...]`` arrays.
    """
    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    nq, nkv, v, e = config.num_heads * d, config.num_kv_heads * d, config.vocab_size, \
        config.num_experts
    out = {"embed": Source("model.embed_tokens.weight", (v, h)),
           "decoder.final_norm": Source("model.norm.weight", (h,))}
    if not config.tie_word_embeddings:
        out["lm_head"] = Source("lm_head.weight", (v, h), transpose=True)
    for i in range(config.num_layers):
        hf_p, p = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf_p + "self_attn."
        out.update({
            p + "input_layernorm": Source(hf_p + "input_layernorm.weight", (h,)),
            p + "post_attention_layernorm": Source(hf_p + "post_attention_layernorm.weight",
                                                   (h,)),
            p + "q_proj": Source(attn + "q_proj.weight", (nq, h), transpose=True),
            p + "k_proj": Source(attn + "k_proj.weight", (nkv, h), transpose=True),
            p + "v_proj": Source(attn + "v_proj.weight", (nkv, h), transpose=True),
            p + "o_proj": Source(attn + "o_proj.weight", (h, nq), transpose=True),
        })
        if config.qkv_bias:
            out.update({p + "q_bias": Source(attn + "q_proj.bias", (nq,)),
                        p + "k_bias": Source(attn + "k_proj.bias", (nkv,)),
                        p + "v_bias": Source(attn + "v_proj.bias", (nkv,))})
        if e:
            moe = hf_p + "block_sparse_moe."

            def experts(w: str, shape: tuple[int, int], moe: str = moe) -> Source:
                names = tuple(f"{moe}experts.{j}.{w}.weight" for j in range(e))
                return Source(names, shape, transpose=True)

            out.update({p + "moe.router": Source(moe + "gate.weight", (e, h), transpose=True),
                        p + "moe.gate_proj": experts("w1", (f, h)),
                        p + "moe.up_proj": experts("w3", (f, h)),
                        p + "moe.down_proj": experts("w2", (h, f))})
        else:
            mlp = hf_p + "mlp."
            out.update({p + "gate_proj": Source(mlp + "gate_proj.weight", (f, h), transpose=True),
                        p + "up_proj": Source(mlp + "up_proj.weight", (f, h), transpose=True),
                        p + "down_proj": Source(mlp + "down_proj.weight", (h, f),
                                                transpose=True)})
    return out


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_checkpoint(ckpt: SafetensorsCheckpoint, sources: Mapping[str, Source],
                     config: DecoderConfig) -> None:
    """Check every source exists with its shape (one error listing all problems); warn about
    checkpoint tensors the model does not use (a tied ``lm_head.weight`` is silently unused)."""
    missing, wrong = [], []
    used: set[str] = set()
    for src in sources.values():
        for name in (src.names if src.stacked else (src.names,)):
            used.add(name)
            if name not in ckpt:
                missing.append(name)
            elif ckpt.info(name).shape != src.shape:
                wrong.append(f"{name}: {ckpt.info(name).shape}, expected {src.shape}")
    problems = []
    if missing:
        problems.append(f"missing tensors: {_few(missing)}")
    if wrong:
        problems.append(f"tensors of the wrong shape (the config implies the expected one): "
                        f"{_few(wrong)}")
    if problems:
        raise CheckpointError(f"{ckpt.path}: " + "; ".join(problems))
    unused = [n for n in ckpt.tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES)
              and not (config.tie_word_embeddings and n == "lm_head.weight")]
    if unused:
        warnings.warn(f"{ckpt.path}: {len(unused)} checkpoint tensors are not used by the "
                      f"model: {_few(unused)}", stacklevel=3)


def from_pretrained(path: str, mesh: Mesh, dtype: Any = None, *, axis_name: str = "tp",
                    model_cls: type | None = None) -> Any:
    """Load a Hugging Face Llama / Mistral / Qwen2 / Mixtral checkpoint directory.

    Builds the model abstractly (no random weights), then each parameter with
    :func:`load_sharded`: every device reads only its own shard of each tensor from the files.

    Args:
      path: directory with ``config.json`` and the safetensors files (+ index).
      mesh: a mesh with the tensor-parallel axis ``axis_name``.
      dtype: parameter dtype; default bfloat16.
      model_cls: the model class (default from ``model_type``: ``LlamaModel``, ``Qwen2Model``,
        ``MixtralModel``); constructed as ``model_cls(config, mesh, axis_name=, dtype=, rngs=)``.

    Returns:
      The model, with ``model.hf_info`` (:class:`HFModelInfo`: config, EOS ids, ...) attached.

    Raises:
      CheckpointError: missing/truncated files, missing tensors, tensors of the wrong shape.
      UnsupportedConfigError: a model type or feature not implemented.
      ValueError: the config does not divide by the mesh's TP degree.
    """
    import jax.numpy as jnp
    from flax import nnx

    from jax_tokenweave.params import named_params, param_spec

    info = load_hf_config(path)
    if model_cls is None:
        model_cls = model_class(info.model_type)
    dtype = jnp.bfloat16 if dtype is None else dtype
    ckpt = SafetensorsCheckpoint(path)
    sources = hf_sources(info.config)
    check_checkpoint(ckpt, sources, info.config)
    model = nnx.eval_shape(lambda: model_cls(info.config, mesh, axis_name=axis_name,
                                             dtype=dtype, rngs=nnx.Rngs(0)))
    params = named_params(model)
    if set(params) != set(sources):
        raise CheckpointError(
            f"internal: parameter names {sorted(set(params) ^ set(sources))} do not match "
            f"between {model_cls.__name__} and the Hugging Face mapping")
    for name, param in params.items():
        abstract = param.get_value()
        src = sources[name]
        if tuple(abstract.shape) != src.target_shape():
            raise CheckpointError(f"internal: {name} has shape {abstract.shape}, the checkpoint "
                                  f"mapping gives {src.target_shape()}")
        param.set_value(load_sharded(ckpt, src, mesh, param_spec(param), abstract.dtype))
    model.hf_info = info
    return model


def model_class(model_type: str) -> type:
    """The model class for a Hugging Face ``model_type``."""
    if model_type in ("llama", "mistral"):
        from jax_tokenweave.models.llama import LlamaModel

        return LlamaModel
    if model_type == "qwen2":
        from jax_tokenweave.models.qwen2 import Qwen2Model

        return Qwen2Model
    if model_type == "mixtral":
        from jax_tokenweave.models.mixtral import MixtralModel

        return MixtralModel
    raise UnsupportedConfigError(
        f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
