"""The serving step's forward program: a packed batch through the model, its K/V into the
paged cache, the logits of the sampled rows (the samplers the host picks:
``serving.runner.sampler``).

The forward stages the step's inputs, runs the model's one forward
(``nn.forward.decoder_forward`` with a ``PagedAttention``) and hands the logits back; its
inputs and logits sit in ``step_io.StepIO`` so decode-only steps replay from command buffers.
Static per program: the ``StepLayout``, the ``nn.forward.ForwardOptions``, the top prompt
log-probabilities; every request-dependent value is traced. See docs/SERVING.md#servingrunnerstep.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_tokenweave.nn import forward as forward_lib
from jax_tokenweave.nn.forward import ForwardOptions
from jax_tokenweave.serving.attention.paged_attention import PagedAttention
from jax_tokenweave.serving.attention.paged_cache import PagedKVCache
from jax_tokenweave.serving.runner.batch import StepArrays, StepLayout
from jax_tokenweave.serving.runner.sampler import SAMPLERS as SAMPLERS  # re-exported: moved there
from jax_tokenweave.serving.runner.sampler import DeviceOutputs, sample_step, sampling_arrays
from jax_tokenweave.serving.runner.sampler import HostOutputs as HostOutputs
from jax_tokenweave.serving.runner.sampler import StepOutputs as StepOutputs
from jax_tokenweave.serving.runner.sampler import jitted_sampler as jitted_sampler
from jax_tokenweave.serving.runner.step_io import ForwardInputs, StepIO, give_back, stage_inputs
from jax_tokenweave.serving.sampling import prompt_logprobs


def model_hidden(
    model: Any,
    cache: PagedKVCache,
    arrays: StepArrays | ForwardInputs,
    layout: StepLayout,
    options: ForwardOptions,
    prev_tokens: jax.Array | None = None,
) -> tuple[jax.Array, PagedKVCache]:
    """Embed and run the stack (``nn.forward.decoder_forward`` with a ``PagedAttention``).
    ``model``: a ``models.llama.LlamaModel``. Returns ``(final-normed hidden [R, H], cache)``.

    ``prev_tokens`` int32 [P] (replicated; ``P >= layout.samples``): the previous step's
    sampled tokens (its ``StepOutputs.tokens``); rows whose ``token_source`` is >= 0 take their
    token from it, on the device (async scheduling)."""
    tokens = arrays.tokens
    if prev_tokens is not None:
        src = arrays.token_source
        tokens = jnp.where(src >= 0, prev_tokens[jnp.maximum(src, 0)], tokens)
    attention = PagedAttention(
        cache,
        arrays.positions,
        arrays.slots,
        arrays.tables,
        decode_rows=layout.decode_rows,
        tile=layout.tile,
    )
    out, (k, v) = forward_lib.decoder_forward(
        model.decoder, model.embed_tokens(tokens), layout.plan, attention, options
    )
    return out, PagedKVCache(k, v)


def model_forward(
    model: Any,
    cache: PagedKVCache,
    arrays: StepArrays | ForwardInputs,
    layout: StepLayout,
    options: ForwardOptions,
    prev_tokens: jax.Array | None = None,
) -> tuple[jax.Array, PagedKVCache]:
    """:func:`model_hidden`, then the sampled rows projected to logits.
    Returns ``(logits [S, V], cache)``."""
    out, cache = model_hidden(model, cache, arrays, layout, options, prev_tokens)
    return model.logits(out[arrays.sample_rows]), cache


def model_step(
    model: Any,
    cache: PagedKVCache,
    arrays: StepArrays,
    layout: StepLayout,
    options: ForwardOptions,
    *,
    num_logprobs: int,
    prev_tokens: jax.Array | None = None,
    sampler: str = "sample",
) -> tuple[DeviceOutputs, PagedKVCache]:
    """:func:`model_forward` then :func:`sample_step` in one function (one program where it is
    jitted whole; the engine runs them as two, see ``jitted_forward``)."""
    logits, cache = model_forward(model, cache, arrays, layout, options, prev_tokens)
    return sample_step(
        logits,
        *sampling_arrays(arrays),
        prev_tokens,
        sampler=sampler,
        num_logprobs=num_logprobs,
        mesh=model.mesh,
    ), cache


STEP_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ""}
"""XLA options of the forward of a step with prompt chunks: no command buffers (those steps are
long and GPU-bound, and their schedules overlap streams at TP >= 2)."""

REPLAY_COMPILER_OPTIONS: dict[str, str] = {}
"""XLA options of the forward of a decode-only step: XLA's defaults, which record the program
as command buffers (CUDA graphs) and replay them. With the inputs and logits at fixed addresses
(``serving.runner.step_io``) a replay updates one kernel; the host then launches one graph instead
of ~400 kernels (one H200, Llama-3-8B shapes, batch 1: ``benchmarks/results/2026-11-24-h200x1``)."""

_FORWARD_STATICS = ("graphdef", "layout", "options", "state_def", "num_prompt_logprobs")


def forward(
    state: Any,
    cache: PagedKVCache,
    io: StepIO | None,
    packed: jax.Array,
    prev_tokens: jax.Array,
    *,
    graphdef: Any,
    layout: StepLayout,
    options: ForwardOptions,
    state_def: Any = None,
    prompt_targets: jax.Array | None = None,
    num_prompt_logprobs: int = 0,
) -> Any:
    """``model_forward`` on ``nnx.merge(graphdef, state)``; returns ``(io, cache)``, and with
    ``prompt_targets`` [R] also ``prompt_logprobs.compute``'s (``num_prompt_logprobs`` top).

    ``packed`` (int32 [N], ``step_io.pack_inputs``) and ``prev_tokens`` [P] are staged into
    ``io``, the logits written there (``io`` None: new buffers that nothing keeps). ``state``
    is the flat list of leaves of the tree ``state_def`` (faster dispatch than an
    ``nnx.State``). Jitted with ``io`` and ``cache`` donated as :data:`jitted_forward` /
    :data:`jitted_forward_replayed`, shared by engines of one model structure. Holds no
    ``lax.cond`` (XLA's GPU runtime would wait on the host for it): the host picks the
    sampler program (``sampler.jitted_sampler``). See docs/SERVING.md#servingrunnerstepforward.
    """
    if state_def is not None:
        state = jax.tree_util.tree_unflatten(state_def, state)
    flat, inputs, prev = stage_inputs(io, packed, prev_tokens, layout)
    model = nnx.merge(graphdef, state)
    out, cache = model_hidden(model, cache, inputs, layout, options, prev)
    io = give_back(io, flat, model.logits(out[inputs.sample_rows]))
    if prompt_targets is None:
        return io, cache
    return io, cache, prompt_logprobs.compute(model, out, prompt_targets, num_prompt_logprobs)


def _jit_forward(options: dict[str, Any]) -> Any:
    return jax.jit(
        forward,
        static_argnames=_FORWARD_STATICS,
        donate_argnames=("cache", "io"),
        compiler_options=options,
    )


jitted_forward = _jit_forward(STEP_COMPILER_OPTIONS)
""":func:`forward` without command buffers (steps with prompt chunks)."""

jitted_forward_replayed = _jit_forward(REPLAY_COMPILER_OPTIONS)
""":func:`forward` replayed from command buffers (decode-only steps)."""

UNSPLIT_K_MIN_ROWS = 64
"""Decode-only steps of at least this many rows compile with XLA's split-K rewrite off
(``xla_gpu_experimental_force_split_k=1``): there it cut the K of the QKV, O and down GEMMs in
two, wrote float32 partials and summed them in separate fusions, and cuBLAS's own kernels
without that rewrite are faster. One H200, Llama-3-8B shapes, 32 layers, GPU busy per step
(``benchmarks/results/2026-11-26-h200x1/fourth_session``): batch 64 6.68 ms against 7.00,
batch 256 15.85 against 15.89; at batch 1 the rewrite wins (4.41 ms against 4.65 without)."""

UNSPLIT_K_OPTION = "xla_gpu_experimental_force_split_k"


@functools.cache
def xla_knows(option: str) -> bool:
    """Whether this jaxlib's XLA takes the compile option ``option`` (an int)."""
    try:
        jax.jit(lambda x: x + 1, compiler_options={option: 1}).lower(np.int32(0)).compile()
    except jax.errors.JaxRuntimeError as err:
        if "No such compile option" in str(err):
            return False
        raise
    return True


@functools.cache
def forward_program(replayed: bool, unsplit_k: bool) -> tuple[Any, dict[str, Any]]:
    """The jitted :func:`forward` of a step and its XLA options: replayed from command buffers
    or not, and (where this XLA knows the option) with split-K off (:data:`UNSPLIT_K_MIN_ROWS`)."""
    options: dict[str, Any] = dict(REPLAY_COMPILER_OPTIONS if replayed else STEP_COMPILER_OPTIONS)
    if not unsplit_k or not xla_knows(UNSPLIT_K_OPTION):
        return (jitted_forward_replayed if replayed else jitted_forward), options
    options[UNSPLIT_K_OPTION] = 1
    return _jit_forward(options), options
