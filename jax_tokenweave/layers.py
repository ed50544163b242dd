"""Tensor-parallel decoder layers and the TokenWeave schedules.

``DecoderLayer`` holds one layer's weights as ``nnx.Param`` arrays sharded over a 1-D mesh axis
(``"tp"``, size N) and exposes per-rank pieces, pure functions of per-rank arrays used inside
``jax.shard_map`` (``nnx.merge`` of the layer's graph with the *local* shards, as
``WeaveDecoder`` does). ``WeaveDecoder`` runs the whole stack inside one ``shard_map``.

Parameters of a layer (global shapes, ``[in, out]`` layout = transpose of a torch ``Linear``):

=========================== ============== ===================== =============================
name                        shape          sharding              Hugging Face Llama tensor
=========================== ============== ===================== =============================
``input_layernorm``         [H]            replicated            ``input_layernorm.weight``
``q_proj``                  [H, Nq*D]      ``P(None, "tp")``     ``self_attn.q_proj.weight``.T
``k_proj`` / ``v_proj``     [H, Nkv*D]     ``P(None, "tp")``     ``self_attn.k/v_proj.weight``.T
``q_bias`` (qkv_bias only)  [Nq*D]         ``P("tp")``           ``self_attn.q_proj.bias``
``k_bias``/``v_bias``       [Nkv*D]        ``P("tp")``           ``self_attn.k/v_proj.bias``
``o_proj``                  [Nq*D, H]      ``P("tp", None)``     ``self_attn.o_proj.weight``.T
``post_attention_layernorm`` [H]           replicated            ``post_attention_layernorm...``
``gate_proj``/``up_proj``   [H, F]         ``P(None, "tp")``     ``mlp.gate/up_proj.weight``.T
``down_proj``               [F, H]         ``P("tp", None)``     ``mlp.down_proj.weight``.T
``moe.*`` (num_experts > 0) see ``jax_tokenweave.moe``
=========================== ============== ===================== =============================

``WeaveDecoder`` names them ``layers.{i}.<name>`` (``layers.{i}.moe.router`` etc.) plus
``final_norm`` [H]; ``params.named_params`` lists them, ``params.load_weights`` sets them from full
arrays with the right ``NamedSharding``. Each Param carries its ``PartitionSpec`` as Flax sharding
metadata (``nnx.get_partition_spec(nnx.state(decoder))`` gives the specs of this table).

Schedules of ``WeaveDecoder.__call__`` (``comm`` picks the communication of ``weave``):

* ``baseline``: plain TP. Residual replicated ``[T, H]``; after each row-parallel GEMM,
  ``allreduce_rmsnorm(impl="xla")`` (psum, then add + RMSNorm on all T rows).
* ``weave``: the halves of ``batch.halves`` (one when the batch is not split), each with its
  residual token-sharded (``[ceil(T_half/N), H]`` per rank). Half B's piece of a request cut by
  the split attends to A's K/V of that request (same layer). The first layer's input norm is
  local (no communication), the last fused op of each half uses the final norm. Half h uses
  workspace ``slot=h``.

  - ``comm="xla"`` (``ops`` impl ``xla_rsag``), or any comm with one half: per layer, in program
    order, attn(A); fused(A); attn(B); fused(B); mlp(A); fused(A, next norm); mlp(B);
    fused(B, next norm). With ``comm="ffi"`` and one half, fused is the synchronous kernel.
  - ``comm="ffi"`` with two halves: each fused op is split into ``start`` (the kernel begins on
    the device's side stream) and ``done`` (XLA's stream waits for it), and the other half's next
    compute runs in between. Program order, ordered by data through
    ``jax.lax.optimization_barrier`` (see :func:`_weave`)::

      attn0(A) -> start(A) ; attn0(B) -> start(B) ; done(A) -> mlp0(A) -> start(A) ;
      done(B) -> mlp0(B) -> start(B) ; done(A) -> attn1(A) -> start(A) ; done(B) -> attn1(B) ...
      ... mlp_last(B) -> start(B) ; done(A) ; done(B)

    so every kernel but the last runs while a GEMM block of the other half computes
    (``jax_tokenweave.hlo_check`` verifies that in compiled HLO).
  - ``comm="auto"``: ``"ffi"`` where ``_ffi.unavailable_reason`` is None for every half's
    ``[T_half, H]`` (with its slot and the CTA count), else ``"xla"``; decided once per call at
    trace time (:func:`resolve_comm`), so both halves use the same path.

  ``tuning`` (a ``jax_tokenweave.tuning.TuneEntry``, default ``tuning.DEFAULT_ENTRY``) gives the
  fused kernel's CTA count (``first_num_ctas`` for the stack's first fused call). Its ``offset``
  is for planning the batch (``tuning.plan_batch``), not used here.
* ``nocomm``: **NOT THE MODEL'S OUTPUT.** ``baseline`` with every collective removed (each rank
  adds its own partial sum only). It exists solely to time the communication away in benchmarks.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_tokenweave import attention as attn_lib
from jax_tokenweave import ops
from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.moe import MoE, reference_moe
from jax_tokenweave.params import (
    ParamSpec,
    load_weights,
    make_param,
    make_params,
    partition_specs,
)
from jax_tokenweave.split import BatchPlan, Half, plan_batch
from jax_tokenweave.tuning import DEFAULT_ENTRY, TuneEntry

Schedule = Literal["baseline", "weave", "nocomm"]
Comm = Literal["auto", "xla", "ffi"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
COMMS: tuple[str, ...] = get_args(Comm)
_COMM_IMPL = {"xla": "xla_rsag", "ffi": "ffi"}


# ------------------------------------------------------------------------------- the layer ----

@functools.lru_cache(maxsize=64)
def _inv_freq(config: DecoderConfig) -> np.ndarray:
    return attn_lib.rope_inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)


class DecoderLayer(nnx.Module):
    """One Llama-style decoder layer (weights sharded as in the module docstring).

    The methods below are per-rank pieces: call them on a layer whose Params hold the *local*
    shards (inside ``shard_map``). ``x`` is always ``[T, H]`` replicated.
    """

    def __init__(self, config: DecoderConfig, mesh: Mesh, *, axis_name: str = "tp",
                 dtype: jnp.dtype = jnp.bfloat16, rngs: nnx.Rngs) -> None:
        config.check_tensor_parallel(mesh.shape[axis_name])
        self.config = config
        self.platform = str(mesh.devices.flat[0].platform)
        h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
        nq, nkv = config.num_heads * d, config.num_kv_heads * d
        col, row, rep = P(None, axis_name), P(axis_name, None), P()
        specs: dict[str, ParamSpec] = {
            "input_layernorm": ((h,), rep, None),
            "q_proj": ((h, nq), col, 1 / np.sqrt(h)),
            "k_proj": ((h, nkv), col, 1 / np.sqrt(h)),
            "v_proj": ((h, nkv), col, 1 / np.sqrt(h)),
            "o_proj": ((nq, h), row, 1 / np.sqrt(nq)),
            "post_attention_layernorm": ((h,), rep, None),
        }
        if config.qkv_bias:
            specs.update(q_bias=((nq,), P(axis_name), 0.5), k_bias=((nkv,), P(axis_name), 0.5),
                         v_bias=((nkv,), P(axis_name), 0.5))
        if config.num_experts == 0:
            specs.update(gate_proj=((h, f), col, 1 / np.sqrt(h)),
                         up_proj=((h, f), col, 1 / np.sqrt(h)),
                         down_proj=((f, h), row, 1 / np.sqrt(f)))
        for name, param in make_params(rngs, specs, dtype, mesh).items():
            setattr(self, name, param)
        if config.num_experts > 0:
            self.moe = MoE(config, mesh, axis_name=axis_name, dtype=dtype, rngs=rngs)

    # -- per-rank pieces ------------------------------------------------------------------
    def input_norm(self, x: jax.Array) -> jax.Array:
        """RMSNorm with ``input_layernorm`` (local, no communication): [T, H] -> [T, H]."""
        return ops.rms_norm(x, self.input_layernorm[...], self.config.rms_norm_eps)

    def qkv(self, x_normed: jax.Array,
            positions: jax.Array | np.ndarray) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Local heads: ``x_normed`` [T, H], ``positions`` [T] -> q [T, Nq/N, D],
        k, v [T, Nkv/N, D]; RoPE applied to q and k."""
        d = self.config.head_dim
        q = jnp.dot(x_normed, self.q_proj[...])
        k = jnp.dot(x_normed, self.k_proj[...])
        v = jnp.dot(x_normed, self.v_proj[...])
        if self.config.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        t = x_normed.shape[0]
        q, k, v = (a.reshape(t, -1, d) for a in (q, k, v))
        inv_freq = _inv_freq(self.config)
        return attn_lib.apply_rope(q, positions, inv_freq), \
            attn_lib.apply_rope(k, positions, inv_freq), v

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, half: Half, *,
                  prefix: Mapping[int, tuple[jax.Array, jax.Array]] | None = None) -> jax.Array:
        """Ragged causal attention of ``half``'s pieces (``attention.ragged_attention``)."""
        impl = attn_lib.default_implementation(self.platform, q.dtype, self.config.head_dim)
        return attn_lib.ragged_attention(q, k, v, half.pieces, origin=half.start,
                                         prefix=prefix, implementation=impl)

    def attention_out(self, attn: jax.Array) -> jax.Array:
        """Row-parallel output projection: [T, Nq/N, D] -> partial [T, H] (sum over ranks)."""
        return jnp.dot(attn.reshape(attn.shape[0], -1), self.o_proj[...])

    def mlp(self, x_normed: jax.Array) -> jax.Array:
        """SwiGLU (or MoE) on [T, H] replicated -> partial [T, H] (sum over ranks)."""
        if self.config.num_experts > 0:
            return self.moe(x_normed)
        gate = jnp.dot(x_normed, self.gate_proj[...])
        up = jnp.dot(x_normed, self.up_proj[...])
        return jnp.dot(jax.nn.silu(gate) * up, self.down_proj[...])


# ------------------------------------------------------------------------------ the stack ----

class WeaveDecoder(nnx.Module):
    """``config.num_layers`` ``DecoderLayer``s and the final norm, run inside one ``shard_map``.

    Args:
      config: model shapes; every sharded dimension must divide by the mesh axis size.
      mesh: a mesh with the tensor-parallel axis ``axis_name``.
      dtype: parameter and activation dtype.
      rngs: ``nnx.Rngs`` for the random initial weights.
    """

    def __init__(self, config: DecoderConfig, mesh: Mesh, *, axis_name: str = "tp",
                 dtype: jnp.dtype = jnp.bfloat16, rngs: nnx.Rngs) -> None:
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
        config.check_tensor_parallel(mesh.shape[axis_name])
        self.config = config
        self.mesh = mesh
        self.axis_name = axis_name
        self.dtype = jnp.dtype(dtype)
        self.layers = nnx.List([
            DecoderLayer(config, mesh, axis_name=axis_name, dtype=dtype, rngs=rngs)
            for _ in range(config.num_layers)])
        self.final_norm = make_param(rngs, (config.hidden_size,), dtype, mesh, P(), None)

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (size of ``axis_name``)."""
        return self.mesh.shape[self.axis_name]

    def load_weights(self, weights: Mapping[str, Any], *, strict: bool = True) -> None:
        """Set weights from full arrays named as in the module docstring (see ``load_weights``)."""
        load_weights(self, self.mesh, weights, strict=strict)

    def __call__(self, hidden: jax.Array, batch: BatchPlan, *, schedule: Schedule = "weave",
                 comm: Comm = "auto", return_kv: bool = False,
                 tuning: TuneEntry | None = None) -> Any:
        """Run the stack on ``hidden`` [T, H] (replicated) laid out as ``batch``.

        Returns the final-normed hidden states [T, H], replicated; with ``return_kv``, also a
        list over layers of ``(k, v)``, each [T, Nkv, D] sharded over heads (``P(None, tp)``),
        RoPE applied to k. ``schedule="nocomm"`` does NOT compute the model (module docstring).
        ``tuning``: the fused kernel's CTA counts (module docstring; ``comm`` ffi only).
        ``comm="ffi"`` where the kernel cannot run raises ``RuntimeError`` saying why.
        """
        check_call(self.config, self.dtype, self.tp, hidden, batch, schedule, comm)
        if tuning is not None and not isinstance(tuning, TuneEntry):
            raise ValueError(f"tuning must be a tuning.TuneEntry or None, got {type(tuning)}")
        entry = DEFAULT_ENTRY if tuning is None else tuning
        resolved = (resolve_comm(comm, self.mesh, self.axis_name, self.dtype, batch,
                                 self.config.hidden_size, entry)
                    if schedule == "weave" else "xla")
        graphdef, state = nnx.split(self)
        specs = partition_specs(self)
        axis = self.axis_name

        def per_rank(state: Any, x: jax.Array) -> Any:
            dec = nnx.merge(graphdef, state)
            if schedule == "weave":
                out, kvs = _weave(dec, x, batch, resolved, entry)
            else:
                out, kvs = _baseline(dec, x, batch, with_comm=schedule == "baseline")
            return (out, kvs) if return_kv else out

        kv_spec = P(None, axis, None)
        out_specs = (P(), [(kv_spec, kv_spec)] * self.config.num_layers) if return_kv else P()
        fn = jax.shard_map(per_rank, mesh=self.mesh, in_specs=(specs, P()),
                           out_specs=out_specs, check_vma=False)
        return fn(state, hidden)


def check_call(config: DecoderConfig, dtype: jnp.dtype, tp: int, hidden: Any, batch: Any,
               schedule: str, comm: str) -> None:
    """Validate ``WeaveDecoder.__call__``'s arguments; raise ``ValueError`` saying what is wrong."""
    config.check_tensor_parallel(tp)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
    if not isinstance(batch, BatchPlan):
        raise ValueError(f"batch must be a split.BatchPlan (see plan_batch), got {type(batch)}")
    shape = tuple(getattr(hidden, "shape", ()))
    if len(shape) != 2:
        raise ValueError(f"hidden must be [tokens, hidden_size], got shape {shape}")
    if shape[0] < 1:
        raise ValueError("hidden has no tokens (empty batch)")
    if shape[1] != config.hidden_size:
        raise ValueError(f"hidden has width {shape[1]}, the config's hidden_size is "
                         f"{config.hidden_size}")
    if shape[0] != batch.num_tokens:
        raise ValueError(f"hidden has {shape[0]} tokens but the batch's request lengths sum to "
                         f"{batch.num_tokens}")
    if not jnp.issubdtype(hidden.dtype, jnp.floating):
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
    if jnp.dtype(hidden.dtype) != jnp.dtype(dtype):
        raise ValueError(f"hidden dtype {hidden.dtype} differs from the model dtype {dtype}")


def ffi_unavailable(mesh: Mesh, axis_name: str, dtype: Any, batch: BatchPlan, hidden_size: int,
                    tuning: TuneEntry | None = None) -> str | None:
    """Why ``schedule="weave", comm="ffi"`` cannot run this batch (None where it can): the first
    half whose ``[T_half, H]`` call (its slot = half index, the tuned CTA counts) is refused by
    ``_ffi.unavailable_reason``."""
    from jax_tokenweave import _ffi

    entry = DEFAULT_ENTRY if tuning is None else tuning
    for j, half in enumerate(batch.halves):
        for ctas in dict.fromkeys((entry.ctas(j == 0), entry.num_ctas)):
            why = _ffi.unavailable_reason(mesh, axis_name, jnp.dtype(dtype),
                                          (half.length, hidden_size), num_ctas=ctas, slot=j)
            if why is not None:
                return f"half {j} ([{half.length}, {hidden_size}]): {why}"
    return None


def resolve_comm(comm: str, mesh: Mesh, axis_name: str, dtype: Any, batch: BatchPlan,
                 hidden_size: int, tuning: TuneEntry | None = None) -> str:
    """The weave schedule's communication for this call, ``"xla"`` or ``"ffi"``.

    ``"xla"`` stays; ``"ffi"`` raises ``RuntimeError`` where :func:`ffi_unavailable` gives a
    reason; ``"auto"`` is ``"ffi"`` where it is available for every half, else ``"xla"``.
    """
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
    if comm == "xla":
        return "xla"
    why = ffi_unavailable(mesh, axis_name, dtype, batch, hidden_size, tuning)
    if why is None:
        return "ffi"
    if comm == "ffi":
        raise RuntimeError(f"comm='ffi' is unavailable: {why} (use comm='auto' or 'xla')")
    return "xla"


# -------------------------------------------------------------------- per-rank schedules ----

def _next_norm_weight(dec: WeaveDecoder, index: int) -> jax.Array:
    if index + 1 < len(dec.layers):
        return dec.layers[index + 1].input_layernorm[...]
    return dec.final_norm[...]


def _baseline(dec: WeaveDecoder, hidden: jax.Array, batch: BatchPlan,
              with_comm: bool) -> tuple[jax.Array, list]:
    """Plain TP on all T tokens, residual replicated; ``with_comm=False`` drops every psum."""
    eps = dec.config.rms_norm_eps
    whole = plan_batch(batch.request_lengths, split=False).halves[0]
    positions = batch.positions()

    def reduce(partial: jax.Array, residual: jax.Array, w: jax.Array):
        if with_comm:
            return ops.allreduce_rmsnorm(partial, residual, w, axis_name=dec.axis_name, eps=eps,
                                         impl="xla")
        return ops.add_rmsnorm(partial, residual, w, eps)

    residual = hidden
    x = dec.layers[0].input_norm(hidden)
    kvs = []
    for i, layer in enumerate(dec.layers):
        q, k, v = layer.qkv(x, positions)
        attn = layer.attention(q, k, v, whole)
        x, residual = reduce(layer.attention_out(attn), residual,
                             layer.post_attention_layernorm[...])
        x, residual = reduce(layer.mlp(x), residual, _next_norm_weight(dec, i))
        kvs.append((k, v))
    return x, kvs


def own_rows(x: jax.Array, axis_name: str) -> jax.Array:
    """Per rank: this rank's ``ceil(T/N)`` rows of ``x`` [T, H] (zero rows past T), the
    token-sharded residual layout of ``ops.allreduce_rmsnorm``."""
    n = jax.lax.axis_size(axis_name)
    rows = ops.rows_per_rank(x.shape[0], n)
    padded = jnp.pad(x, ((0, rows * n - x.shape[0]), (0, 0)))
    return jax.lax.dynamic_slice_in_dim(padded, jax.lax.axis_index(axis_name) * rows, rows, 0)


def _prefixes(half: Half, earlier_k: list[jax.Array],
              earlier_v: list[jax.Array]) -> dict[int, tuple[jax.Array, jax.Array]]:
    """K/V prefixes of ``half``'s pieces with position > 0, cut from the earlier halves' K/V.

    The earlier halves cover global tokens ``[0, half.start)`` in order.
    """
    out = {}
    for piece in half.pieces:
        if piece.position > 0:
            if not earlier_k:
                raise ValueError(f"piece {piece} needs a K/V prefix but no earlier half exists")
            k_all = jnp.concatenate(earlier_k) if len(earlier_k) > 1 else earlier_k[0]
            v_all = jnp.concatenate(earlier_v) if len(earlier_v) > 1 else earlier_v[0]
            lo = piece.start - piece.position
            out[piece.request] = (k_all[lo:piece.start], v_all[lo:piece.start])
    return out


def _weave(dec: WeaveDecoder, hidden: jax.Array, batch: BatchPlan, comm: str,
           tuning: TuneEntry = DEFAULT_ENTRY) -> tuple[jax.Array, list]:
    """TokenWeave: halves interleaved layer by layer, residual token-sharded per half.

    ``comm`` is resolved (``"xla"`` or ``"ffi"``, see :func:`resolve_comm`). With ``"ffi"`` and
    two halves, every fused op is a ``start``/``done`` pair overlapped with the other half's
    compute (module docstring); each step of half j ("stage": attn or mlp of one layer) is

    1. make j's input ready: if j has a kernel in flight, ``done(j)`` -- ordered after the other
       half's latest ``start`` (hence after the compute that fed it) by passing both pendings
       through one ``optimization_barrier``; if not (layer 0), pass j's input through a barrier
       with the other half's pending so j's compute is ordered after that ``start``;
    2. compute j's partial sum (attention block or MLP), which depends on 1;
    3. ``start(j)`` on slot j (reused only after its ``done`` in 1).

    After the last layer: ``done(A)`` (after ``start(B)``), then ``done(B)``.
    """
    eps, axis = dec.config.rms_norm_eps, dec.axis_name
    halves = batch.halves
    overlap = comm == "ffi" and len(halves) == 2
    impl = _COMM_IMPL[comm]
    ncalls = [0]

    def ctas() -> int:
        ncalls[0] += 1
        return tuning.ctas(ncalls[0] == 1)

    positions = [h.positions() for h in halves]
    inputs = [hidden[h.start:h.end] for h in halves]
    residual = [own_rows(x, axis) for x in inputs]
    x = [dec.layers[0].input_norm(xh) for xh in inputs]
    pending: list[Any] = [None] * len(halves)

    def ready(j: int) -> None:
        """Step 1 above (overlap only): x[j], residual[j] valid, ordered after the other start."""
        from jax_tokenweave import _ffi

        other = 1 - j
        if pending[j] is not None:
            if pending[other] is not None:
                pending[j], pending[other] = jax.lax.optimization_barrier(
                    (pending[j], pending[other]))
            x[j], residual[j] = _ffi.allreduce_rmsnorm_done(pending[j], axis_name=axis,
                                                            mesh=dec.mesh, slot=j)
            pending[j] = None
        elif pending[other] is not None:
            pending[other], x[j] = jax.lax.optimization_barrier((pending[other], x[j]))

    def fused(partial: jax.Array, j: int, w: jax.Array) -> None:
        """Steps 3 (overlap: start) or the synchronous fused op into x[j], residual[j]."""
        if overlap:
            from jax_tokenweave import _ffi

            pending[j] = _ffi.allreduce_rmsnorm_start(partial, residual[j], w, axis_name=axis,
                                                      mesh=dec.mesh, eps=eps, num_ctas=ctas(),
                                                      slot=j)
        else:
            x[j], residual[j] = ops.allreduce_rmsnorm(
                partial, residual[j], w, axis_name=axis, eps=eps, impl=impl, mesh=dec.mesh,
                slot=j, num_ctas=ctas() if comm == "ffi" else None)

    kvs = []
    for i, layer in enumerate(dec.layers):
        ks: list[jax.Array] = []
        vs: list[jax.Array] = []
        for j, half in enumerate(halves):
            if overlap:
                ready(j)
            q, k, v = layer.qkv(x[j], positions[j])
            attn = layer.attention(q, k, v, half, prefix=_prefixes(half, ks, vs))
            fused(layer.attention_out(attn), j, layer.post_attention_layernorm[...])
            ks.append(k)
            vs.append(v)
        w_next = _next_norm_weight(dec, i)
        for j in range(len(halves)):
            if overlap:
                ready(j)
            fused(layer.mlp(x[j]), j, w_next)
        kvs.append((_cat(ks), _cat(vs)))
    if overlap:
        for j in range(len(halves)):
            ready(j)
    return _cat(x), kvs


def _cat(parts: list[jax.Array]) -> jax.Array:
    return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


# ----------------------------------------------------------------------- float reference ----

def _ref_rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def reference_decoder(weights: Mapping[str, np.ndarray], config: DecoderConfig,
                      hidden: np.ndarray, request_lengths: tuple[int, ...],
                      prefix: str = "") -> np.ndarray:
    """Float64 single-device, unsharded reference of ``WeaveDecoder`` (any schedule but nocomm).

    ``weights``: full arrays named as ``params.named_params`` (with ``prefix`` prepended, e.g.
    ``"decoder."``); ``hidden``: [T, H]. Returns the final-normed hidden states [T, H].
    """
    w = {k[len(prefix):]: np.asarray(v, np.float64) for k, v in weights.items()
         if k.startswith(prefix)}
    eps, d = config.rms_norm_eps, config.head_dim
    lengths = tuple(request_lengths)
    positions = plan_batch(lengths, split=False).positions()
    inv_freq = _inv_freq(config)
    h = np.asarray(hidden, np.float64)
    t = h.shape[0]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        x = _ref_rms(h, w[p + "input_layernorm"], eps)
        q, k, v = x @ w[p + "q_proj"], x @ w[p + "k_proj"], x @ w[p + "v_proj"]
        if config.qkv_bias:
            q, k, v = q + w[p + "q_bias"], k + w[p + "k_bias"], v + w[p + "v_bias"]
        q = attn_lib.reference_rope(q.reshape(t, -1, d), positions, inv_freq)
        k = attn_lib.reference_rope(k.reshape(t, -1, d), positions, inv_freq)
        attn = attn_lib.reference_attention(q, k, v.reshape(t, -1, d), lengths)
        h = h + attn.reshape(t, -1) @ w[p + "o_proj"]
        x = _ref_rms(h, w[p + "post_attention_layernorm"], eps)
        if config.num_experts > 0:
            mlp = reference_moe(x, w[p + "moe.router"], w[p + "moe.gate_proj"],
                                w[p + "moe.up_proj"], w[p + "moe.down_proj"],
                                config.experts_per_token)
        else:
            g, u = x @ w[p + "gate_proj"], x @ w[p + "up_proj"]
            mlp = (g / (1 + np.exp(-g)) * u) @ w[p + "down_proj"]
        h = h + mlp
    return _ref_rms(h, w["final_norm"], eps)
