"""Per-device reads of safetensors checkpoints (``safetensors.safe_open``).

:func:`load_sharded` builds a ``jax.Array`` under a ``NamedSharding``; each addressable device
reads only its block of the global shape, so no host holds a full sharded tensor. A
:class:`Source` with ``transpose=True`` yields ``[in, out]`` from Hugging Face's ``[out, in]``.
Checkpoint layout and slicing: docs/PACKAGE.md#hfreader.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 with NumPy, as safetensors needs)
import numpy as np
import safetensors
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_tokenweave.hf.config import read_json
from jax_tokenweave.hf.errors import CheckpointError
from jax_tokenweave.nn.fused_layout import segments

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, safetensors dtype name (e.g. ``"BF16"``) and shape."""

    file: str
    dtype: str
    shape: tuple[int, ...]


def _open(path: str) -> Any:
    """``safe_open(path, framework="numpy")``; a corrupt file raises :class:`CheckpointError`."""
    try:
        return safetensors.safe_open(path, framework="numpy")
    except (safetensors.SafetensorError, OSError) as e:
        raise CheckpointError(
            f"{path}: not a readable safetensors file (truncated or corrupt): {e}"
        ) from e


class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory (single file or sharded with an index).

    Opening reads only the headers; :meth:`read` reads a block of one tensor from its file.
    """

    def __init__(self, path: str):
        self.path = path
        index_path = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index_path):
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) and f == os.path.basename(f) for f in weight_map.values()
            ):
                raise CheckpointError(
                    f"{index_path} needs a 'weight_map' of tensor name -> file name in {path}"
                )
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise CheckpointError(
                f"{path}: no safetensors weights ({INDEX_FILE} or {SINGLE_FILE}) found"
            )
        self.tensors: dict[str, TensorInfo] = {}
        self._handles: dict[str, Any] = {}
        for name in files:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise CheckpointError(f"missing shard file {file} (listed in {INDEX_FILE})")
            handle = self._handles[file] = _open(file)
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                block = handle.get_slice(key)
                self.tensors[key] = TensorInfo(
                    file, block.get_dtype(), tuple(int(d) for d in block.get_shape())
                )
        if weight_map is not None:
            absent = [
                k
                for k, f in weight_map.items()
                if k not in self.tensors or os.path.basename(self.tensors[k].file) != f
            ]
            if absent:
                raise CheckpointError(
                    f"{path}: tensors listed in {INDEX_FILE} are missing from their files: "
                    f"{few(absent)}"
                )

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        """The :class:`TensorInfo` of ``name``; :class:`CheckpointError` if absent."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: checkpoint has no tensor {name!r}")
        return self.tensors[name]

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """``tensor[index]`` (basic slices, step 1) as a NumPy array; only that block is read."""
        info = self.info(name)
        index = tuple(index) + (slice(None),) * (len(info.shape) - len(index))
        try:
            return np.asarray(self._handles[info.file].get_slice(name)[index])
        except (safetensors.SafetensorError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{info.file}: cannot read tensor {name!r} ({info.dtype} {list(info.shape)}): {e}"
            ) from e


def few(names: Sequence[str], n: int = 5) -> str:
    """The first ``n`` names, comma-separated, with a count of the rest."""
    more = f" (and {len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


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

    @property
    def all_names(self) -> tuple[str, ...]:
        return self.names if isinstance(self.names, tuple) else (self.names,)

    def target_shape(self) -> tuple[int, ...]:
        shape = self.shape[:-2] + self.shape[-2:][::-1] if self.transpose else self.shape
        return (len(self.names), *shape) if self.stacked else shape


@dataclasses.dataclass(frozen=True)
class Fused:
    """A target whose last axis is the rank-blocked concatenation of ``parts``' last axes for
    TP degree ``tp`` (``nn.fused_layout``): a device's block of it reads only the matching
    blocks of each part (for a ``P(None, "tp")`` shard, exactly its rank's rows of each stored
    tensor)."""

    parts: tuple[Source, ...]
    tp: int

    @property
    def all_names(self) -> tuple[str, ...]:
        return tuple(n for p in self.parts for n in p.all_names)

    def target_shape(self) -> tuple[int, ...]:
        shapes = [p.target_shape() for p in self.parts]
        return (*shapes[0][:-1], sum(s[-1] for s in shapes))


def check_source(ckpt: SafetensorsCheckpoint, src: Source | Fused) -> None:
    """Raise :class:`CheckpointError` unless every tensor of ``src`` exists with its shape."""
    if isinstance(src, Fused):
        for part in src.parts:
            check_source(ckpt, part)
        return
    missing = [n for n in src.all_names if n not in ckpt]
    if missing:
        raise CheckpointError(f"{ckpt.path}: missing tensors: {few(missing)}")
    for n in src.all_names:
        got = ckpt.info(n).shape
        if got != src.shape:
            raise CheckpointError(
                f"{ckpt.path}: tensor {n!r} has shape {got}, the config implies {src.shape}"
            )


def _read_target_slice(
    ckpt: SafetensorsCheckpoint, src: Source | Fused, index: tuple[slice, ...]
) -> np.ndarray:
    """The block ``target[index]`` of the target array described by ``src``."""
    index = tuple(index) + (slice(None),) * (len(src.target_shape()) - len(index))
    if isinstance(src, Fused):
        lo, hi, _ = index[-1].indices(src.target_shape()[-1])
        blocks = []
        for seg in segments([p.target_shape()[-1] for p in src.parts], src.tp):
            a, b = max(lo, seg.fused_start), min(hi, seg.fused_start + seg.length)
            if a < b:
                start = seg.part_start + a - seg.fused_start
                blocks.append(
                    _read_target_slice(
                        ckpt, src.parts[seg.part], (*index[:-1], slice(start, start + b - a))
                    )
                )
        return np.concatenate(blocks, axis=-1)
    if isinstance(src.names, tuple):
        picks = range(len(src.names))[index[0]]
        return np.stack(
            [
                _read_target_slice(ckpt, Source(src.names[i], src.shape, src.transpose), index[1:])
                for i in picks
            ]
        )
    if src.transpose:
        stored = (*index[:-2], index[-1], index[-2])
        return np.swapaxes(ckpt.read(src.names, stored), -1, -2)
    return ckpt.read(src.names, index)


def load_sharded(
    ckpt: SafetensorsCheckpoint, src: Source | Fused, mesh: Mesh, spec: PartitionSpec, dtype: Any
) -> jax.Array:
    """A ``jax.Array`` of ``src.target_shape()`` sharded as ``NamedSharding(mesh, spec)``.

    Each addressable device's callback reads only its own block from the file (devices with the
    same block, e.g. replicas, share one read). The result is cast to ``dtype`` on the host.
    """
    check_source(ckpt, src)
    cache: dict[tuple, np.ndarray] = {}

    def callback(index: tuple[slice, ...] | None) -> np.ndarray:
        # jax passes every device's index (its type admits None, which jax asserts against)
        assert index is not None
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            cache[key] = np.ascontiguousarray(
                _read_target_slice(ckpt, src, index).astype(dtype, copy=False)
            )
        return cache[key]

    return jax.make_array_from_callback(src.target_shape(), NamedSharding(mesh, spec), callback)
