"""``ModelRunner``: the device side of the engine: state, paged KV cache, step programs.

:meth:`ModelRunner.dispatch` packs a scheduled step (``serving.batch``) and dispatches it
without waiting (-> :class:`InFlight`); :meth:`ModelRunner.fetch` brings its tokens (and
asked-for log-probabilities) to the host. Sampled tokens (int32 ``[max_num_seqs]``, replicated)
stay on the device as the next step's ``prev_tokens``. A step is two programs, the forward and
a sampler; :meth:`ModelRunner.warmup` loads or compiles them all. See docs/SERVING.md#servingrunner.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jax_tokenweave.serving import batch as batch_lib
from jax_tokenweave.serving import checks, memory
from jax_tokenweave.serving import executable_cache as exe_cache
from jax_tokenweave.serving.buckets import decode_only_rows, decode_rows, next_pow2
from jax_tokenweave.serving.compilation_cache import use_compilation_cache
from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.executable_cache import ExecutableCache, WarmupReport
from jax_tokenweave.serving.paged_attention import resolve_for
from jax_tokenweave.serving.paged_cache import init_paged_cache
from jax_tokenweave.serving.scheduler import ScheduledStep
from jax_tokenweave.serving.step import (
    SAMPLERS,
    UNSPLIT_K_MIN_ROWS,
    DeviceOutputs,
    HostOutputs,
    StepOutputs,
    forward_program,
    jitted_forward,
    jitted_sampler,
    sampling_arrays,
)
from jax_tokenweave.serving.step_io import StepIO, new_io, pack_inputs


@dataclasses.dataclass(eq=False)
class InFlight:
    """A dispatched step: what was scheduled, its layout, its outputs (device arrays, maybe
    still being computed) and whether it computed log-probabilities."""

    scheduled: ScheduledStep
    layout: batch_lib.StepLayout
    outputs: DeviceOutputs
    want_logprobs: bool


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
        memory.check_pool_fits(  # before allocating: a pool too large is refused at once
            memory.pool_need(self.model_config, config, self.tp, dtype),
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
        self.model_type = f"{type(model).__module__}.{type(model).__qualname__}"
        self.platform = str(self.mesh.devices.flat[0].platform)
        self.executable_cache = ExecutableCache(
            None
            if config.compilation_cache_dir is None
            else os.path.join(os.path.expanduser(config.compilation_cache_dir), exe_cache.SUBDIR)
        )
        self._executables: dict[batch_lib.StepLayout, Any] = {}  # warmed-up forwards
        self._samplers: dict[tuple[int, str, int], Any] = {}  # (rows, sampler, logprobs)
        self._io: dict[batch_lib.StepLayout, StepIO] = {}  # each layout's fixed buffers

    def close(self, weights: bool = False) -> int:
        """Give the device memory back: delete the KV pool, the step buffers and, with
        ``weights``, the model's weights (shared with the model object), and drop the compiled
        programs held. Returns how many arrays were deleted. The runner is unusable after."""
        arrays: list[Any] = [self.cache, self.no_tokens, list(self._io.values())]
        if weights:
            arrays.append(self._leaves)
        deleted = memory.delete_arrays(arrays)
        self._io.clear()
        self._executables.clear()
        self._samplers.clear()
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
        """``layout``'s :class:`~jax_tokenweave.serving.step_io.StepIO` where its forward
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
        cfg = self.config
        return dict(
            graphdef=self.graphdef,
            layout=layout,
            schedule=cfg.schedule,
            collective=cfg.collective,
            key_chunk=cfg.key_chunk,
            tuning=cfg.tuning,
            attention=cfg.attention,
            state_def=self._state_def,
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
        picks (greedy where no sampled row draws; log-probabilities only where one asked).
        The cache is replaced by the step's. Returns its device outputs. ``prev_tokens``: the
        previous step's ``StepOutputs.tokens`` (default zeros)."""
        prev = self.no_tokens if prev_tokens is None else prev_tokens
        program = self._executables.get(layout)
        args = (self._leaves, self.cache, self.io(layout), pack_inputs(arrays), prev)
        if program is None:
            io, self.cache = self._jitted(layout)(*args, **self._static(layout))
        else:
            io, self.cache = program(*args)
        if self.replayed(layout):
            self._io[layout] = io
        logits = io.logits
        sampler = "sample" if np.any(np.asarray(arrays.temperature) > 0) else "greedy"
        logprobs = self.config.max_logprobs if bool(arrays.want_logprobs) else 0
        settings = sampling_arrays(arrays)
        compiled = self._samplers.get((layout.samples, sampler, logprobs))
        if compiled is not None:
            return compiled(logits, *settings, prev)
        return jitted_sampler(
            logits, *settings, prev, sampler=sampler, num_logprobs=logprobs, mesh=self.mesh
        )

    def dispatch(
        self,
        scheduled: ScheduledStep,
        arrays: tuple[batch_lib.StepLayout, batch_lib.StepArrays],
        previous: InFlight | None = None,
    ) -> InFlight:
        """Dispatch a packed step (``arrays``: :meth:`pack`'s) whose decodes may take tokens
        from ``previous`` (the step dispatched before it); starts copying its tokens to the
        host."""
        layout, host = arrays
        outputs = self.run(layout, host, None if previous is None else previous.outputs.tokens)
        want = bool(host.want_logprobs)
        for leaf in (
            (outputs.tokens, outputs.logprob, outputs.top_logprobs, outputs.top_ids)
            if want
            else (outputs.tokens,)
        ):
            leaf.copy_to_host_async()
        return InFlight(scheduled, layout, outputs, want)

    @staticmethod
    def fetch(step: InFlight) -> HostOutputs:
        """The step's outputs on the host (NumPy; waits for the device): the sampled tokens
        ([:len(sampled)] are real), and the log-probabilities where the step computed them
        (else None)."""
        out = step.outputs
        if step.want_logprobs:
            return jax.device_get(out)
        return jax.device_get(StepOutputs(out.tokens, None, None, None))

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
        """Make every layout's program (afterwards no step compiles): load it from the
        executable cache, else trace and lower it (one after the other) and compile it
        (``workers`` threads, default one per CPU) and store it. ``progress``: a progress bar.
        Returns how many layouts were loaded and compiled."""
        start = time.perf_counter()
        layouts = self.layouts()
        args = {layout: self.padding_args(layout) for layout in layouts}
        cache, comms, keys = self.executable_cache, {}, {}
        if cache.enabled:  # the fused kernel's communicator first: keys record its id
            comms = exe_cache.step_communicators(self.mesh, self.axis_name, self.config)
            keys = {layout: self.program_key(layout, args[layout], comms) for layout in layouts}
        out_tree = jax.tree_util.tree_structure((StepIO(0, 0), self.cache))  # type: ignore[arg-type]
        bar = tqdm(total=len(layouts), desc="warm-up", unit="layout", disable=not progress)
        counts = {"loaded": 0, "compiled": 0}
        lock = threading.Lock()

        def done(layout: batch_lib.StepLayout, program: Any, how: str) -> None:
            with lock:
                self._executables[layout] = program
                counts[how] += 1
                bar.set_postfix(counts, refresh=False)
                bar.update()

        def compile_and_store(layout: batch_lib.StepLayout, lowered: Any) -> None:
            program, unstorable = exe_cache.compile_to_store(lowered, self.platform)
            if layout in keys and program.out_tree != out_tree:  # a load would rebuild a
                cache.disable(
                    f"the step's output tree {program.out_tree} is not the "  # wrong
                    f"expected {out_tree}"
                )  # tree
            elif (
                layout in keys
                and unstorable is None
                and exe_cache.unknown_communicators(program, comms) is None
            ):
                cache.store(keys[layout], program)
            done(layout, program, "compiled")

        with bar, concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
            missing = layouts
            if keys:
                exe_cache.register_ffi_targets()  # before XLA loads programs naming them
                found = list(
                    pool.map(
                        lambda layout: cache.load(
                            keys[layout], args[layout], out_tree, list(self.mesh.devices.flat)
                        ),
                        layouts,
                    )
                )
                for layout, program in zip(layouts, found, strict=True):
                    if program is not None:
                        done(layout, program, "loaded")
                missing = [layout for layout, p in zip(layouts, found, strict=True) if p is None]
            futures = [
                pool.submit(
                    compile_and_store,
                    layout,
                    self._jitted(layout).lower(*args[layout], **self._static(layout)),
                )
                for layout in missing
            ]
            for future in futures:
                future.result()
            self._warm_samplers(pool)
        self._first_runs(layouts)
        return WarmupReport(
            len(layouts), counts["loaded"], counts["compiled"], time.perf_counter() - start
        )

    def _first_runs(self, layouts: list[batch_lib.StepLayout]) -> None:
        """With prompt tiles on cuDNN, run each layout that has them once on padding rows
        (they write nothing): XLA builds a cuDNN call's plan on its first run, ~14 ms per call
        on an H200, so a layout's first step would stall (32 layers: about 0.9 s)."""
        if self.attention() != "cudnn":
            return
        for layout in layouts:
            if not layout.decode_only:
                self.run(layout, batch_lib.pack_padding(layout, self.config))
        jax.block_until_ready(self.cache)

    def attention(self) -> str:
        """The paged attention the steps run (``paged_attention.resolve_for`` of
        ``EngineConfig.attention`` on this mesh, dtype and heads)."""
        return resolve_for(
            self.config.attention, self.platform, self.cache.k[0].dtype, self.model_config
        )

    def _warm_samplers(self, pool: concurrent.futures.Executor) -> None:
        """Make the sampler programs every warmed-up layout may pick: per sampled-row count,
        greedy or drawn, with log-probabilities or not, on the forward program's logits
        (shape, dtype, sharding from its ``out_info``); loaded from the executable cache, else
        compiled (small) and stored."""
        cache, devices = self.executable_cache, list(self.mesh.devices.flat)
        out_tree = jax.tree_util.tree_structure(StepOutputs(0, 0, 0, 0))
        wanted: dict[tuple[int, str, int], tuple[tuple[Any, ...], dict[str, Any]]] = {}
        for layout, program in self._executables.items():
            padding = batch_lib.pack_padding(layout, self.config)
            inputs = (program.out_info[0].logits, *sampling_arrays(padding), self.no_tokens)
            for sampler in SAMPLERS:
                for logprobs in sorted({0, self.config.max_logprobs}):
                    which = (layout.samples, sampler, logprobs)
                    if which not in self._samplers:
                        wanted[which] = (
                            inputs,
                            {"sampler": sampler, "num_logprobs": logprobs, "mesh": self.mesh},
                        )

        def make(inputs: tuple[Any, ...], static: dict[str, Any]) -> Any:
            key = (
                exe_cache.program_key(
                    {
                        "function": f"{jitted_sampler.__module__}.sample_step",
                        "static": static,
                        "inputs": exe_cache.describe_args(inputs),
                    },
                    devices,
                )
                if cache.enabled
                else None
            )
            program = None if key is None else cache.load(key, inputs, out_tree, devices)
            if program is None:
                program, unstorable = exe_cache.compile_to_store(
                    jitted_sampler.lower(*inputs, **static), self.platform
                )
                if key is not None and unstorable is None:
                    cache.store(key, program)
            return program

        made = pool.map(lambda item: make(*item), wanted.values())
        self._samplers.update(zip(wanted, made, strict=True))

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
