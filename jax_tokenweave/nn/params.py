"""Sharded parameters: creation, names, partition specs and loading from full arrays.

Every parameter is an ``nnx.Param`` created already placed with ``NamedSharding(mesh, spec)``
and annotated with Flax's own sharding metadata (``nnx.with_partitioning``), so
``nnx.get_partition_spec(nnx.state(module))`` gives each parameter's real ``PartitionSpec`` and
any tool driven by Flax's metadata (an Orbax restore, ``nnx.get_named_sharding``,
``nnx.as_abstract``) places the weights as the model does. The metadata is descriptive only
(``eager_sharding=False``): the values are placed here, never re-sharded by Flax, so the same
module can be merged with per-rank shards inside ``jax.shard_map``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.nn.fused_layout import FUSED_PARAMS, PART_OF, fuse_weights, unfuse_weights

ParamSpec = tuple[tuple[int, ...], P, float | None]
"""``(global shape, PartitionSpec, std)`` of a parameter; ``std=None`` means ones (norms)."""


@functools.lru_cache(maxsize=128)
def _init_fn(
    specs: tuple[tuple[str, ParamSpec], ...], dtype: jnp.dtype, mesh: Mesh
) -> Callable[[jax.Array], dict[str, jax.Array]]:
    """One jitted initialiser for a group of parameters (compiled once per shapes/mesh/dtype)."""
    shardings = {name: NamedSharding(mesh, spec) for name, (_, spec, _) in specs}

    def init(key: jax.Array) -> dict[str, jax.Array]:
        keys = jax.random.split(key, len(specs))
        out = {}
        for k, (name, (shape, _, std)) in zip(keys, specs, strict=True):
            if std is None:
                out[name] = jnp.ones(shape, dtype)
            else:
                out[name] = (jax.random.normal(k, shape, jnp.float32) * std).astype(dtype)
        return out

    return jax.jit(init, out_shardings=shardings)


def sharded_param(value: Any, spec: P, mesh: Mesh) -> nnx.Param:
    """An ``nnx.Param`` holding ``value`` (already placed) with Flax sharding metadata ``spec``."""
    annotated = nnx.with_partitioning(lambda: value, tuple(spec), mesh=mesh)()
    return nnx.Param(annotated, eager_sharding=False)


def make_params(
    rngs: nnx.Rngs, specs: Mapping[str, ParamSpec], dtype: jnp.dtype, mesh: Mesh
) -> dict[str, nnx.Param]:
    """``nnx.Param``s created directly with ``NamedSharding(mesh, spec)`` by one jitted call.

    ``specs``: ``{name: (shape, spec, std)}``; ``std=None``: ones, else normal(0, std). Each
    Param carries ``spec`` as Flax sharding metadata (module docstring).
    """
    frozen = tuple(
        (name, (tuple(shape), spec, None if std is None else float(std)))
        for name, (shape, spec, std) in specs.items()
    )
    values = _init_fn(frozen, jnp.dtype(dtype), mesh)(rngs.params())
    return {name: sharded_param(values[name], spec, mesh) for name, (_, spec, _) in specs.items()}


def make_param(
    rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, mesh: Mesh, spec: P, std: float | None
) -> nnx.Param:
    """A single parameter (see :func:`make_params`)."""
    return make_params(rngs, {"p": (shape, spec, std)}, dtype, mesh)["p"]


def named_params(module: nnx.Module) -> dict[str, nnx.Param]:
    """``{dotted name: Param}`` of a module, e.g. ``"layers.0.q_proj"``."""
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return {".".join(str(p) for p in path): var for path, var in flat}


def param_spec(param: nnx.Variable) -> P:
    """The ``PartitionSpec`` of one parameter, read from its Flax sharding metadata."""
    return nnx.get_partition_spec(param).get_value()


def partition_specs(module: nnx.Module) -> Any:
    """``nnx.state(module, nnx.Param)`` with every Param replaced by its ``PartitionSpec``: the
    ``in_specs`` of that state for ``jax.shard_map`` (from ``nnx.get_partition_spec``)."""
    return jax.tree.map(
        lambda v: v.get_value(),
        nnx.get_partition_spec(nnx.state(module, nnx.Param)),
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def load_weights(
    module: nnx.Module, mesh: Mesh, weights: Mapping[str, Any], *, strict: bool = True
) -> None:
    """Set Params from full (global) arrays, placed with ``NamedSharding(mesh, param_spec)``.

    ``weights``: ``{dotted name: array}`` (NumPy or ``jax.Array``), names as :func:`named_params`;
    the logical parts of a fused parameter (``layers.0.q_proj``, ``k_proj``, ``v_proj``; see
    ``nn.fused_layout``) may stand in for it, all of a group together, and are fused for
    the module's TP degree. Each array must have the Param's global shape; it is cast to the
    Param's dtype. Unknown names raise ``ValueError``; with ``strict``, so do missing ones.
    """
    params = named_params(module)
    tp = _fused_tp(params, mesh)
    if tp is not None and any(n.rpartition(".")[2] in PART_OF for n in weights):
        weights = fuse_weights(weights, tp)
    unknown = sorted(set(weights) - set(params))
    if unknown:
        raise ValueError(f"unknown parameter names {unknown}; known: {sorted(params)}")
    missing = sorted(set(params) - set(weights))
    if strict and missing:
        raise ValueError(f"missing parameters {missing}")
    for name, array in weights.items():
        param = params[name]
        old = param[...]
        if tuple(array.shape) != tuple(old.shape):
            raise ValueError(f"{name}: expected shape {tuple(old.shape)}, got {array.shape}")
        sharding = NamedSharding(mesh, param_spec(param))
        if isinstance(array, jax.Array):
            value = jax.device_put(array.astype(old.dtype), sharding)
        else:
            value = jax.device_put(np.asarray(array).astype(old.dtype), sharding)
        param.set_value(value)


def numpy_weights(module: nnx.Module) -> dict[str, np.ndarray]:
    """``{dotted name: full NumPy array}`` (gathers the shards; for tests and references)."""
    return {name: np.asarray(jax.device_get(p[...])) for name, p in named_params(module).items()}


@runtime_checkable
class _Placed(Protocol):
    """A model built for a config on a mesh (``WeaveDecoder``, ``models.llama.LlamaModel``)."""

    config: DecoderConfig
    mesh: Mesh


def logical_weights(module: nnx.Module) -> dict[str, np.ndarray]:
    """:func:`numpy_weights` with every fused parameter split into its logical parts
    (``q_proj``, ``k_proj``, ...: the layout of Hugging Face checkpoints, independent of the TP
    degree). ``module`` must have a ``config`` (``DecoderConfig``) and a ``mesh``."""
    if not isinstance(module, _Placed):
        raise AttributeError(f"{type(module).__name__} has no config and mesh (logical_weights)")
    weights = numpy_weights(module)
    tp = _fused_tp(named_params(module), module.mesh)
    return weights if tp is None else unfuse_weights(weights, module.config, tp)


def _fused_tp(params: Mapping[str, nnx.Param], mesh: Mesh) -> int | None:
    """The TP degree the module's fused parameters are laid out for (None: it has none)."""
    for name, param in params.items():
        if name.rpartition(".")[2] in FUSED_PARAMS:
            axis = param_spec(param)[-1]
            return 1 if axis is None else mesh.shape[axis]
    return None
