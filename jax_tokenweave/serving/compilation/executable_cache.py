"""Compiled step programs on disk (``jax.experimental.serialize_executable``), so a restart of
the same model skips tracing, lowering and compiling: one file per program under
``<compilation_cache_dir>/executables/``, named by its key (``serving.compilation.executable_key``).
A file that does not match or fails to load is ignored with a warning and recompiled; writes are
atomic. Files are unpickled and loaded as machine code: trust the directory as the package.
Details: docs/SERVING.md#servingcompilationexecutable_cache."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import re
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from jax_tokenweave.serving.compilation.executable_key import (
    describe_args as describe_args,  # re-exported
)
from jax_tokenweave.serving.compilation.executable_key import describe_leaf as describe_leaf
from jax_tokenweave.serving.compilation.executable_key import environment as environment
from jax_tokenweave.serving.compilation.executable_key import leaf_dtype, leaf_shape
from jax_tokenweave.serving.compilation.executable_key import program_key as program_key
from jax_tokenweave.serving.compilation.executable_key import source_hash as source_hash

SUBDIR = "executables"
MAGIC = b"jax-tokenweave executable v1\n"
_DIGEST = hashlib.sha256().digest_size


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What a warm-up did: ``layouts`` programs ready, ``loaded`` of them from the executable
    cache and ``compiled`` (traced, lowered, compiled), in ``seconds``."""

    layouts: int
    loaded: int
    compiled: int
    seconds: float


class Serializer(Protocol):
    """Turns a ``jax.stages.Compiled`` into bytes and back (tests use a fake one)."""

    def serialize(self, compiled: Any) -> bytes: ...

    def deserialize(
        self, payload: bytes, in_tree: Any, out_tree: Any, devices: Sequence[Any]
    ) -> Any: ...


class JaxSerializer:
    """``jax.experimental.serialize_executable`` (jax 0.10 and 0.11 share its API:
    ``serialize(compiled) -> (bytes, in_tree, out_tree)``,
    ``deserialize_and_load(bytes, in_tree, out_tree, backend, execution_devices)``).
    ``devices``: the program's devices in its device assignment's order (a mesh's
    ``devices.flat``); JAX's default, all the backend's devices, aborts the process (an XLA
    check) for a program on fewer."""

    def __init__(self) -> None:
        from jax.experimental import serialize_executable  # ImportError: the cache is off

        self._module = serialize_executable

    def serialize(self, compiled: Any) -> bytes:
        return self._module.serialize(compiled)[0]

    def deserialize(
        self, payload: bytes, in_tree: Any, out_tree: Any, devices: Sequence[Any]
    ) -> Any:
        devices = list(devices)
        return self._module.deserialize_and_load(
            payload, in_tree, out_tree, backend=devices[0].client, execution_devices=devices
        )


def _check_args(compiled: Any, args: Any) -> None:
    """Raises ``ValueError`` where ``compiled`` was not compiled for ``args``' shapes and
    dtypes (``args``: the positional arguments, as ``jit`` flattens them with no kwargs)."""
    want = jax.tree_util.tree_leaves(compiled.args_info)
    got = jax.tree_util.tree_leaves((args, {}))
    if len(want) != len(got):
        raise ValueError(f"{len(want)} arguments compiled, {len(got)} given")
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        if tuple(w.shape) != leaf_shape(g) or np.dtype(w.dtype) != leaf_dtype(g):
            raise ValueError(
                f"argument {i}: compiled for {w.dtype}{list(w.shape)}, given "
                f"{leaf_dtype(g)}{list(leaf_shape(g))}"
            )


class ExecutableCache:
    """Compiled programs in ``directory`` (None: the cache is off: loads nothing, writes
    nothing). ``serializer`` default :class:`JaxSerializer`; without JAX's serialization
    module the cache turns itself off with one warning. Thread-safe."""

    def __init__(
        self, directory: str | os.PathLike | None, serializer: Serializer | None = None
    ) -> None:
        self.directory = (
            None if directory is None else Path(os.path.expanduser(os.fspath(directory)))
        )
        self._lock = threading.Lock()
        self._unserializable = False
        self._serializer = serializer
        if self.directory is not None and serializer is None:
            try:
                self._serializer = JaxSerializer()
            except ImportError as e:
                self.disable(f"jax.experimental.serialize_executable is unavailable ({e})")

    @property
    def enabled(self) -> bool:
        """Whether the cache loads and stores: it has a directory and JAX's switch for
        compilation caching (``jax_enable_compilation_cache``) is on."""
        return self.directory is not None and bool(
            jax.config.values["jax_enable_compilation_cache"]
        )

    def path(self, key: str) -> Path | None:
        """The file of ``key``'s program (None: the cache is off)."""
        directory = self.directory
        return None if directory is None else directory / f"{key}.bin"

    def disable(self, why: str) -> None:
        """Turn the cache off (loads and stores nothing more), warning once with ``why``."""
        with self._lock:
            if self.directory is None:
                return
            self.directory = None
        warnings.warn(
            f"executable cache off: {why}; warm-up compiles every layout",
            RuntimeWarning,
            stacklevel=3,
        )

    def load(self, key: str, args: Any, out_tree: Any, devices: Sequence[Any]) -> Any | None:
        """The program stored under ``key``, checked against ``args`` (the positional
        arguments it will be called with; its input tree is theirs), returning ``out_tree``,
        loaded onto ``devices`` (its device assignment, in order: a mesh's ``devices.flat``);
        None where there is none, or (with a warning) where the file is corrupt or does not
        load."""
        directory = self.directory
        if directory is None or not self.enabled:
            return None
        path = directory / f"{key}.bin"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(
                f"executable cache: cannot read {path} ({e}); compiling",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        try:
            payload = self._unpack(data, key)
            in_tree = jax.tree_util.tree_structure((args, {}))
            serializer = self._serializer
            if serializer is None:  # (the cache turned itself off: no serializer)
                return None
            compiled = serializer.deserialize(payload, in_tree, out_tree, devices)
            _check_args(compiled, args)
            return compiled
        except Exception as e:  # any failure to load means: compile instead
            warnings.warn(
                f"executable cache: ignoring {path} ({type(e).__name__}: {e}); compiling",
                RuntimeWarning,
                stacklevel=2,
            )
            return None

    def store(self, key: str, compiled: Any) -> bool:
        """Write ``compiled`` under ``key`` (atomically); False where the cache is off, or
        (warning once per cache) where JAX cannot serialize the program: a backend without
        serialization, or on XLA:CPU a program with a sort that has already run (its
        comparator is then a built-in ``LessThan``; only an executable JAX's in-memory cache
        hands back can have run). Such a program is compiled again at the next start."""
        directory = self.directory
        if directory is None or not self.enabled:
            return False
        try:
            serializer = self._serializer
            if serializer is None:  # (the cache turned itself off: no serializer)
                return False
            payload = serializer.serialize(compiled)
        except Exception as e:  # whatever JAX raises: warm-up goes on without this file
            with self._lock:
                first, self._unserializable = not self._unserializable, True
            if first:
                warnings.warn(
                    f"executable cache: cannot serialize a step program "
                    f"({type(e).__name__}: {e}); it is compiled again at the next "
                    f"start",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return False
        body = pickle.dumps({"key": key, "executable": payload}, protocol=5)
        path = directory / f"{key}.bin"
        try:
            atomic_write(path, MAGIC + hashlib.sha256(body).digest() + body)
        except OSError as e:
            warnings.warn(
                f"executable cache: cannot write {path} ({e})", RuntimeWarning, stacklevel=2
            )
            return False
        return True

    @staticmethod
    def _unpack(data: bytes, key: str) -> bytes:
        if not data.startswith(MAGIC):
            raise ValueError("not an executable-cache file (bad magic)")
        digest, body = data[len(MAGIC) : len(MAGIC) + _DIGEST], data[len(MAGIC) + _DIGEST :]
        if hashlib.sha256(body).digest() != digest:
            raise ValueError("checksum mismatch (truncated or corrupt)")
        record = pickle.loads(body)
        if not isinstance(record, dict) or record.get("key") != key:
            raise ValueError("stored for another key")
        return record["executable"]


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory renamed into
    place: readers see the old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def register_ffi_targets() -> None:
    """Register the CUDA extension's FFI targets (fused all-reduce, paged attention) where it
    is built: a loaded executable calls them by name, and XLA resolves the names when it loads
    the program, which tracing (skipped on a load) would otherwise have done first."""
    from jax_tokenweave.kernel import _extension, _ffi
    from jax_tokenweave.serving.attention import attention_kernel

    if _extension.import_error() is None:
        _ffi.register_targets()
        attention_kernel._register()


_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()  # JAX persistent-cache hits seen by this thread
_listener_lock = threading.Lock()
_listening = False


def _count_cache_hits(event: str, *args: Any, **kwargs: Any) -> None:
    if event == _CACHE_HIT_EVENT:
        _hits.count = getattr(_hits, "count", 0) + 1


def compile_to_store(lowered: Any, platform: str) -> tuple[Any, str | None]:
    """``(lowered.compile(), why it must not be stored or None)``. On XLA:CPU a program that JAX
    took from its persistent compilation cache must not be stored: serialized again, it loads
    and then fails at its first run ("Error dispatching computation: Function
    bitcast_concatenate_fusion not found", jax 0.10.2; reproduced by a restart with
    ``executables/`` removed and JAX's cache kept). The cache hit is seen through JAX's
    monitoring event, which JAX records in the compiling thread. GPU programs round-trip."""
    global _listening
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_count_cache_hits)
            _listening = True
    before = getattr(_hits, "count", 0)
    compiled = lowered.compile()
    if platform == "cpu" and getattr(_hits, "count", 0) > before:
        return compiled, (
            "XLA:CPU took it from JAX's persistent compilation cache, and such a "
            "program does not survive a second serialization"
        )
    return compiled, None


_COMM_ID = re.compile(r"comm_id\s*=\s*(-?\d+)")


def step_communicators(mesh: Any, axis_name: str, config: Any) -> dict[str, str]:
    """The communicator the engine's step programs will name, registered now so that its id
    is fixed before their keys are made, as ``{id: identity}`` (``kernel.comm.Communicator``;
    the id as text): where the engine weaves with the fused kernel (``config.schedule`` weave,
    ``collective`` auto or ffi, the extension built, GPUs), the shared communicator of
    ``mesh``'s ``axis_name``, the one the weave path's calls take. Else, or where the kernel
    cannot run there, ``{}``: no program names one."""
    from jax_tokenweave.kernel import _extension
    from jax_tokenweave.kernel.comm import get_communicator

    if (
        config.schedule != "weave"
        or config.collective not in ("auto", "ffi")
        or _extension.import_error() is not None
        or mesh.devices.flat[0].platform != "gpu"
    ):
        return {}
    comm = get_communicator(mesh, axis_name)
    try:
        comm_id = comm.comm_id  # registers the workspace
    except RuntimeError:  # the kernel cannot run here
        return {}
    return {str(comm_id): comm.identity()}


def unknown_communicators(compiled: Any, known: dict[str, str]) -> str | None:
    """Why ``compiled`` must not be stored (None: it may). Its calls of the fused kernel name
    their communicator by this process's id: it is stored only where every id it names is in
    ``known`` (the communicators its key records), so a later process loads it under the same
    key only where the same ids name the same communicators."""
    from jax_tokenweave.kernel import _extension, _ffi

    if _extension.import_error() is not None:
        return None
    text = compiled.as_text() or ""
    if not any(target in text for target in _ffi.TARGETS.values()):
        return None
    ids = set(_COMM_ID.findall(text))
    if not ids:
        return "it calls the fused kernel, and its text names no communicator id"
    if missing := sorted(ids - set(known), key=int):
        return f"it names communicator ids {missing}, which its key does not record"
    return None
