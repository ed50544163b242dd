"""Stage copies at the edges of the serving step, so XLA's command buffers replay.

XLA captures the step's kernels into CUDA graphs (command buffers) and re-records a graph
whenever an address it touches changes. The step's inputs (tokens, positions, tables, the
previous step's tokens) and its outputs are new buffers every step; the weights, the donated
KV cache and XLA's scratch space are not. :func:`stage` copies arrays through one FFI call
(``tokenweave_stage``, ``ffi/stage_handler.h``) that XLA never captures: put at the start of the
step (inputs -> buffers of the step's own) and at its end (results -> outputs), it leaves the
graph between them touching only addresses that stay put, so XLA replays it unchanged.
"""

from __future__ import annotations

import functools
from typing import TypeVar

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_tokenweave import _extension

TARGET = "tokenweave_stage"
Tree = TypeVar("Tree")


@functools.cache
def _register() -> None:
    jax.ffi.register_ffi_target(TARGET, _extension.get().attention_handlers()["stage"],
                                platform="CUDA")


def stage(tree: Tree, mesh: Mesh) -> Tree:
    """Copies of the arrays of ``tree`` (replicated over ``mesh``), made on each device by one
    call outside XLA's command buffers. Needs the CUDA extension and a mesh of GPUs."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    _register()

    def copy(*xs: jax.Array) -> list[jax.Array]:
        call = jax.ffi.ffi_call(TARGET, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs])
        return call(*xs)

    spec = tuple(P() for _ in leaves)
    copied = jax.shard_map(copy, mesh=mesh, in_specs=spec, out_specs=list(spec),
                           check_vma=False)(*leaves)
    return jax.tree_util.tree_unflatten(treedef, copied)
