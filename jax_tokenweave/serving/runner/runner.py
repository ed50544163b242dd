"""``ModelRunner``: the device side of the engine: state, paged KV cache, step programs.

:meth:`ModelRunner.dispatch` packs a scheduled step (``serving.runner.batch``) and dispatches it
without waiting (-> :class:`InFlight`); :meth:`ModelRunner.fetch` brings its tokens (and
asked-for log-probabilities) to the host. Sampled tokens (int32 ``[max_num_seqs]``, replicated)
stay on the device as the next step's ``prev_tokens``. A step is two programs, the forward and
a sampler; :meth:`ModelRunner.warmup` loads or compiles them all. See
docs/SERVING.md#servingrunnerrunner.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, cast

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_tokenweave.nn.forward import ForwardOptions
from jax_tokenweave.serving import checks
from jax_tokenweave.serving.attention.paged_attention import resolve_for
from jax_tokenweave.serving.attention.paged_cache import init_paged_cache
from jax_tokenweave.serving.buckets import decode_only_rows, decode_rows, next_pow2
from jax_tokenweave.serving.compilation import executable_cache as exe_cache
from jax_tokenweave.serving.compilation.compilation_cache import use_compilation_cache
from jax_tokenweave.serving.compilation.executable_cache import ExecutableCache, WarmupReport
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.runner import batch as batch_lib
from jax_tokenweave.serving.runner import memory
from jax_tokenweave.serving.runner import warmup as warmup_lib
from jax_tokenweave.serving.runner.sampler import (
    DeviceOutputs,
    HostOutputs,
    StepOutputs,
    jitted_processed_sampler,
    jitted_sampler,
    sampling_arrays,
)
from jax_tokenweave.serving.runner.step import UNSPLIT_K_MIN_ROWS, forward_program, jitted_forward
from jax_tokenweave.serving.runner.step_io import StepIO, new_io, pack_inputs
from jax_tokenweave.serving.sampling import processors
from jax_tokenweave.serving.sampling import prompt_logprobs as prompt_lp
from jax_tokenweave.serving.sampling.prompt_logprobs import PromptLogprobs
from jax_tokenweave.serving.scheduling.scheduler import ScheduledStep
from jax_tokenweave.weave.schedules import Collective, Schedule


@dataclasses.dataclass(eq=False)
class InFlight:
    """A dispatched step: what was scheduled, its layout, its outputs (device arrays, maybe
    still being computed), whether it computed log-probabilities, and its prompt's."""

    scheduled: ScheduledStep
    layout: batch_lib.StepLayout
    outputs: DeviceOutputs
    want_logprobs: bool
    # prompt log-probabilities of its rows, and (request, first row, position, count) of
    # each chunk that asked (serving.sampling.prompt_logprobs)
    prompt: PromptLogprobs[jax.Array] | None = None
    asked: tuple[tuple[Any, int, int, int], ...] = ()


class ModelRunner:
    """Runs steps of ``model`` (a ``models.llama.LlamaModel``) over a paged KV cache sized by
    ``config`` (module docstring)."""

    def __init__(self, model: Any, config: EngineConfig) -> None:
        checks.single_process_mesh(model.mesh, jax.process_index())
        self.config = config
        self.compilation_cache_dir = use_compilation_cache(config.compilation_cache_dir)
        self.model_config = model.config
        self.mesh, self.axis_name = model.mesh, model.axis_name
        self.tp = self.mesh.shape[self.axis_name]
        self.graphdef, self.state = nnx.split(model)
        self._leaves, self._state_def = jax.tree_util.tree_flatten(self.state)
        dtype = model.embed.get_value().dtype
        slots, vocab, biased = (
            config.max_num_seqs,
            self.model_config.vocab_size,
            config.max_biased_tokens,
        )
        memory.check_pool_fits(  # before allocating: a pool too large is refused at once
            memory.pool_need(
                self.model_config,
                config,
                self.tp,
                dtype,
                processors.state_bytes(slots, vocab, biased),
            ),
            list(self.mesh.devices.flat),
        )
        self.cache = init_paged_cache(
            self.model_config,
            self.mesh,
            config.num_blocks,
            config.block_size,
            dtype,
            self.axis_name,
        )
        self.no_tokens = jax.device_put(
            np.zeros(config.max_num_seqs, np.int32), NamedSharding(self.mesh, P())
        )
        self.processors = processors.init_state(self.mesh, slots, vocab, biased)
        self.options = ForwardOptions(
            schedule=cast(Schedule, config.schedule),  # EngineConfig checked both
            collective=cast(Collective, config.collective),
            tuning=config.tuning,
            attention=config.attention,
            key_chunk=config.key_chunk,
        )
        self.model_type = f"{type(model).__module__}.{type(model).__qualname__}"
        self.platform = str(self.mesh.devices.flat[0].platform)
        self.executable_cache = ExecutableCache(
            None
            if config.compilation_cache_dir is None
            else os.path.join(os.path.expanduser(config.compilation_cache_dir), exe_cache.SUBDIR)
        )
        self._executables: dict[batch_lib.StepLayout, Any] = {}  # warmed-up forwards
        # (rows, sampler, logprobs, processed) -> sampler; prompt bucket -> slot write
        self._samplers: dict[tuple[int, str, int, bool], Any] = {}
        self._slot_starts: dict[int, Any] = {}
        self._io: dict[batch_lib.StepLayout, StepIO] = {}  # each layout's fixed buffers

    def close(self, weights: bool = False) -> int:
        """Give the device memory back: delete the KV pool, the step buffers and, with
        ``weights``, the model's weights (shared with the model object), and drop the compiled
        programs held. Returns how many arrays were deleted. The runner is unusable after."""
        arrays: list[Any] = [self.cache, self.no_tokens, self.processors, list(self._io.values())]
        if weights:
            arrays.append(self._leaves)
        deleted = memory.delete_arrays(arrays)
        self._io.clear()
        self._executables.clear()
        self._samplers.clear()
        self._slot_starts.clear()
        return deleted

    def replayed(self, layout: batch_lib.StepLayout) -> bool:
        """Whether ``layout``'s forward replays from command buffers: a decode-only step, where
        ``EngineConfig.command_buffers`` is on."""
        return self.config.command_buffers and layout.decode_only

    def _forward(self, layout: batch_lib.StepLayout) -> tuple[Any, dict[str, Any]]:
        """``layout``'s jitted forward and its XLA options (``step.forward_program``): split-K
        off for decode-only steps of at least ``step.UNSPLIT_K_MIN_ROWS`` rows."""
        return forward_program(
            self.replayed(layout), layout.decode_only and layout.rows >= UNSPLIT_K_MIN_ROWS
        )

    def _jitted(self, layout: batch_lib.StepLayout) -> Any:
        return self._forward(layout)[0]

    def io(self, layout: batch_lib.StepLayout) -> StepIO | None:
        """``layout``'s :class:`~jax_tokenweave.serving.runner.step_io.StepIO` where its forward
        replays (made on first use, then kept); None for the others, which keep no buffers."""
        if not self.replayed(layout):
            return None
        io = self._io.get(layout)
        if io is None:
            cfg = self.config
            io = self._io[layout] = new_io(
                layout, cfg.table_width, cfg.max_num_seqs, self.model_config.vocab_size, self.mesh
            )
        return io

    def _static(self, layout: batch_lib.StepLayout) -> dict[str, Any]:
        return dict(
            graphdef=self.graphdef, layout=layout, options=self.options, state_def=self._state_def
        )

    def pack(self, scheduled: ScheduledStep) -> tuple[batch_lib.StepLayout, batch_lib.StepArrays]:
        """The step's layout and host arrays (``batch.pack``)."""
        return batch_lib.pack(scheduled, self.config, self.model_config, self.tp)

    def run(
        self,
        layout: batch_lib.StepLayout,
        arrays: batch_lib.StepArrays,
        prev_tokens: jax.Array | None = None,
    ) -> DeviceOutputs:
        """Dispatch the step (no wait): the forward program, then the sampler program the host
        picks (greedy where no sampled row draws; log-probabilities only where one asked;
        processed where a row needs ``serving.sampling.processors``). The cache is replaced by the
        step's. Returns its device outputs. ``prev_tokens``: the previous step's
        ``StepOutputs.tokens`` (default zeros)."""
        return self._run(layout, arrays, prev_tokens)[0]

    def _run(
        self,
        layout: batch_lib.StepLayout,
        arrays: batch_lib.StepArrays,
        prev_tokens: jax.Array | None = None,
    ) -> tuple[DeviceOutputs, PromptLogprobs[jax.Array] | None]:
        """:meth:`run`, and the prompt log-probabilities where the step asked."""
        prev = self.no_tokens if prev_tokens is None else prev_tokens
        program = self._executables.get(layout)
        args = (self._leaves, self.cache, self.io(layout), pack_inputs(arrays), prev)
        prompt = None
        if bool(arrays.want_prompt_logprobs):  # a variant compiled at first use
            io, self.cache, prompt = self._jitted(layout)(
                *args,
                **self._static(layout),
                prompt_targets=arrays.prompt_targets,
                num_prompt_logprobs=self.config.max_logprobs,
            )
        elif program is None:
            io, self.cache = self._jitted(layout)(*args, **self._static(layout))
        else:
            io, self.cache = program(*args)
        if self.replayed(layout):
            self._io[layout] = io
        return self._sample(layout, arrays, io.logits, prev), prompt

    def _sample(
        self, layout: batch_lib.StepLayout, arrays: batch_lib.StepArrays, logits: Any, prev: Any
    ) -> DeviceOutputs:
        """The step's sampler program on its ``logits`` (see :meth:`run`)."""
        sampler = "sample" if np.any(np.asarray(arrays.temperature) > 0) else "greedy"
        logprobs = self.config.max_logprobs if bool(arrays.want_logprobs) else 0
        processed = bool(arrays.processed)
        settings = sampling_arrays(arrays)
        compiled = self._samplers.get((layout.samples, sampler, logprobs, processed))
        static = {"sampler": sampler, "num_logprobs": logprobs, "mesh": self.mesh}
        if not processed:
            if compiled is not None:
                return compiled(logits, *settings, prev)
            return jitted_sampler(logits, *settings, prev, **static)
        more = (self.processors, arrays.processor_slots, arrays.penalties)
        if compiled is not None:
            out, self.processors = compiled(logits, *settings, prev, *more)
        else:
            out, self.processors = jitted_processed_sampler(
                logits, *settings, prev, *more, **static
            )
        return out

    def start_slots(self, scheduled: ScheduledStep) -> None:
        """Write the processor state's slot of each request ``scheduled`` admits that needs it
        (``processors.start_slot``: its prompt's ids and the tokens it made already, its bias
        table), before its first step."""
        cfg, vocab = self.config, self.model_config.vocab_size
        for seq in scheduled.admitted:
            if not processors.needs_slot(seq.params):
                continue
            entries = processors.bias_entries(seq.params, seq.stop_ids)
            start = processors.slot_start(
                seq.slot, seq.prompt, seq.output, entries, vocab, cfg.max_biased_tokens
            )
            args = (
                np.int32(start.slot),
                start.ids,
                start.history,
                start.bias_ids,
                start.bias_values,
                start.bias_until,
            )
            program = self._slot_starts.get(start.ids.shape[0], processors.jitted_start_slot)
            self.processors = program(self.processors, *args)

    def dispatch(
        self,
        scheduled: ScheduledStep,
        arrays: tuple[batch_lib.StepLayout, batch_lib.StepArrays],
        previous: InFlight | None = None,
    ) -> InFlight:
        """Dispatch a packed step (``arrays``: :meth:`pack`'s) whose decodes may take tokens
        from ``previous`` (the step dispatched before it), after its admitted requests' slot
        writes (:meth:`start_slots`); starts copying its tokens to the host."""
        layout, host = arrays
        self.start_slots(scheduled)
        prev = None if previous is None else previous.outputs.tokens
        if bool(host.want_prompt_logprobs):
            outputs, prompt = self._run(layout, host, prev)
        else:  # through run(), which the benchmarks' probes time
            outputs, prompt = self.run(layout, host, prev), None
        want = bool(host.want_logprobs)
        leaves: list[Any] = [outputs.tokens]
        if want:
            leaves += [outputs.logprob, outputs.top_logprobs, outputs.top_ids]
        asked: tuple[tuple[Any, int, int, int], ...] = ()
        if prompt is not None:
            leaves += jax.tree_util.tree_leaves(prompt)
            first = batch_lib.chunk_first_rows(scheduled, layout)
            asked = tuple(prompt_lp.targets(scheduled.chunks, first, layout.rows)[1])
        for leaf in leaves:
            leaf.copy_to_host_async()
        return InFlight(scheduled, layout, outputs, want, prompt, asked)

    @staticmethod
    def fetch(step: InFlight) -> HostOutputs:
        """The step's outputs on the host (NumPy; waits for the device): the sampled tokens
        ([:len(sampled)] are real), and the log-probabilities where the step computed them
        (else None)."""
        out = step.outputs
        if step.want_logprobs:
            return jax.device_get(out)
        return jax.device_get(StepOutputs(out.tokens, None, None, None))

    @staticmethod
    def fetch_prompt(step: InFlight) -> PromptLogprobs[np.ndarray] | None:
        """The step's prompt log-probabilities on the host (None where it computed none)."""
        return None if step.prompt is None else jax.device_get(step.prompt)

    def layouts(self) -> list[batch_lib.StepLayout]:
        """Every step layout this configuration can produce."""
        cfg, tile = self.config, self.config.prefill_tile
        budget = cfg.max_num_batched_tokens
        ladder = sorted(
            {min(next_pow2(n), budget) for n in (tile << i for i in range(budget.bit_length() + 1))}
            | {budget}
        )
        counts = range(1, cfg.max_num_seqs + 1)
        decodes = sorted({0} | {decode_rows(n, tile) for n in counts})
        mixed = [(d, r) for d in decodes for r in ladder if r >= max(d, tile) and r <= budget]
        only = sorted({(d, d) for d in (decode_only_rows(n, tile) for n in counts)} - set(mixed))
        make = batch_lib.make_layout
        return [make(d, r, cfg, self.model_config, self.tp) for d, r in mixed + only]

    def warmup(self, workers: int | None = None, progress: bool = False) -> WarmupReport:
        """Make every program a step can run (``serving.runner.warmup``; afterwards no step
        compiles): loaded from the executable cache, else compiled (``workers`` threads) and
        stored. ``progress``: a progress bar. Returns how many layouts were loaded and
        compiled."""
        return warmup_lib.warm(self, workers, progress)

    def attention(self) -> str:
        """The paged attention the steps run (``paged_attention.resolve_for`` of
        ``EngineConfig.attention`` on this mesh, dtype and heads)."""
        return resolve_for(
            self.config.attention, self.platform, self.cache.k[0].dtype, self.model_config
        )

    def padding_args(self, layout: batch_lib.StepLayout) -> tuple[Any, ...]:
        """The forward program's arguments for ``layout`` with padding rows only (what warm-up
        compiles with): the state's leaves, the cache, the layout's ``StepIO``, the packed
        arrays, the previous tokens."""
        padding = batch_lib.pack_padding(layout, self.config)
        return (self._leaves, self.cache, self.io(layout), pack_inputs(padding), self.no_tokens)

    def program_key(
        self,
        layout: batch_lib.StepLayout,
        args: tuple[Any, ...],
        communicators: dict[str, str] | None = None,
    ) -> str:
        """The executable cache's key of ``layout``'s program on ``args`` (state, cache,
        arrays, prev_tokens): ``executable_cache.program_key`` of everything that makes the
        program (the static arguments, the model, the inputs' tree, shapes, dtypes and
        shardings, the compiler options, the fused kernel's communicator by id and identity:
        ``communicators``, ``executable_cache.step_communicators``) and the environment."""
        static = {k: repr(v) for k, v in self._static(layout).items() if k != "graphdef"}
        options = self._forward(layout)[1]
        return exe_cache.program_key(
            {
                **self._model_key,
                "compiler_options": options,
                "communicators": communicators or {},
                "static": static,
                "inputs": exe_cache.describe_args(args),
            },
            self.mesh.devices.flat,
        )

    @functools.cached_property
    def _model_key(self) -> dict[str, Any]:
        return {
            "function": f"{jitted_forward.__module__}.forward",
            "model_type": self.model_type,
            "model_config": repr(self.model_config),
            "graphdef": [repr(self.graphdef), repr(getattr(self.graphdef, "attributes", None))],
        }
