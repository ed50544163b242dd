"""``ModelRunner.warmup``: every program a stream of requests can run, made before the first
request, so none compiles later: each layout's forward, the samplers of each sampled-row count
(greedy or drawn, with log-probabilities or not, processed or not: ``serving.runner.sampler``) and
the processor state's slot writes (``serving.sampling.processors``, one per prompt bucket). Each is
loaded from the executable cache or traced, lowered, compiled and stored there. Not made: the
forward variant of steps with prompt log-probabilities (``serving.sampling.prompt_logprobs``)."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jax_tokenweave.serving.compilation import executable_cache as exe_cache
from jax_tokenweave.serving.compilation.executable_cache import WarmupReport
from jax_tokenweave.serving.runner import batch as batch_lib
from jax_tokenweave.serving.runner.sampler import (
    SAMPLERS,
    StepOutputs,
    jitted_processed_sampler,
    jitted_sampler,
    sampling_arrays,
)
from jax_tokenweave.serving.runner.step_io import StepIO
from jax_tokenweave.serving.sampling import processors


def warm(runner: Any, workers: int | None = None, progress: bool = False) -> WarmupReport:
    """Make ``runner``'s (a ``ModelRunner``) programs (module docstring): the forwards in
    ``workers`` threads (default one per CPU) after tracing and lowering them one after the
    other; a layout's samplers in the same threads as soon as its forward is made, beside the
    other forwards. ``progress``: a progress bar. Returns how many layouts were loaded and
    compiled, and the seconds it took."""
    start = time.perf_counter()
    layouts = runner.layouts()
    args = {layout: runner.padding_args(layout) for layout in layouts}
    cache, comms, keys = runner.executable_cache, {}, {}
    if cache.enabled:  # the fused kernel's communicator first: keys record its id
        comms = exe_cache.step_communicators(runner.mesh, runner.axis_name, runner.config)
        keys = {layout: runner.program_key(layout, args[layout], comms) for layout in layouts}
    out_tree = jax.tree_util.tree_structure((StepIO(0, 0), runner.cache))  # type: ignore[arg-type]
    bar = tqdm(total=len(layouts), desc="warm-up", unit="layout", disable=not progress)
    counts = {"loaded": 0, "compiled": 0}
    lock = threading.Lock()
    small: _SmallPrograms | None = None

    def done(layout: batch_lib.StepLayout, program: Any, how: str) -> None:
        with lock:
            runner._executables[layout] = program
            counts[how] += 1
            bar.set_postfix(counts, refresh=False)
            bar.update()
        assert small is not None
        small.add_samplers(layout, program)

    def compile_and_store(layout: batch_lib.StepLayout, lowered: Any) -> None:
        program, unstorable = exe_cache.compile_to_store(lowered, runner.platform)
        if layout in keys and program.out_tree != out_tree:  # a load would rebuild a wrong tree
            cache.disable(f"the step's output tree {program.out_tree} is not the {out_tree}")
        elif (
            layout in keys
            and unstorable is None
            and exe_cache.unknown_communicators(program, comms) is None
        ):
            cache.store(keys[layout], program)
        done(layout, program, "compiled")

    devices = list(runner.mesh.devices.flat)
    with bar, concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        small = _SmallPrograms(runner, pool)
        small.add_slot_starts()
        missing = layouts
        if keys:
            exe_cache.register_ffi_targets()  # before XLA loads programs naming them
            found = list(
                pool.map(
                    lambda layout: cache.load(keys[layout], args[layout], out_tree, devices),
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
                runner._jitted(layout).lower(*args[layout], **runner._static(layout)),
            )
            for layout in missing
        ]
        for future in futures:
            future.result()
        small.wait()  # those of the last forwards may still be compiling
    _first_runs(runner, layouts)
    return WarmupReport(
        len(layouts), counts["loaded"], counts["compiled"], time.perf_counter() - start
    )


def _first_runs(runner: Any, layouts: list[batch_lib.StepLayout]) -> None:
    """With prompt tiles on cuDNN, run each layout that has them once on padding rows (they
    write nothing): XLA builds a cuDNN call's plan on its first run, ~14 ms per call on an
    H200, so a layout's first step would stall (32 layers: about 0.9 s)."""
    if runner.attention() != "cudnn":
        return
    for layout in layouts:
        if not layout.decode_only:
            runner.run(layout, batch_lib.pack_padding(layout, runner.config))
    jax.block_until_ready(runner.cache)


def _load_or_compile(
    runner: Any, jitted: Any, name: str, inputs: tuple[Any, ...], static: dict[str, Any], out: Any
) -> Any:
    """``jitted`` on ``inputs`` (``static`` keywords), loaded from the executable cache under a
    key of ``name``, the static arguments and the inputs' description, else compiled and
    stored; ``out``: its output tree."""
    cache, devices = runner.executable_cache, list(runner.mesh.devices.flat)
    key = None
    if cache.enabled:
        description = {"function": name, "static": static}
        description["inputs"] = exe_cache.describe_args(inputs)
        key = exe_cache.program_key(description, devices)
    program = None if key is None else cache.load(key, inputs, out, devices)
    if program is None:
        program, unstorable = exe_cache.compile_to_store(
            jitted.lower(*inputs, **static), runner.platform
        )
        if key is not None and unstorable is None:
            cache.store(key, program)
    return program


class _SmallPrograms:
    """The samplers every warmed-up layout may pick, on its forward's logits (shape, dtype,
    sharding from its ``out_info``), and the slot writes of every prompt bucket: each made in
    ``pool`` as soon as its inputs are known (a layout's samplers once its forward is made, so
    they compile beside the other forwards), each once; :meth:`wait` stores them in ``runner``."""

    def __init__(self, runner: Any, pool: concurrent.futures.Executor) -> None:
        self.runner, self.pool = runner, pool
        self.lock = threading.Lock()
        self.samplers: dict[Any, concurrent.futures.Future[Any]] = {}
        self.starts: dict[int, concurrent.futures.Future[Any]] = {}

    def _submit(self, item: tuple[Any, str, tuple[Any, ...], dict[str, Any], Any]) -> Any:
        return self.pool.submit(_load_or_compile, self.runner, *item)

    def add_samplers(self, layout: batch_lib.StepLayout, program: Any) -> None:
        """Submit the samplers of ``layout`` (its forward ``program`` made) not yet submitted."""
        runner = self.runner
        module = jitted_sampler.__module__
        padding = batch_lib.pack_padding(layout, runner.config)
        inputs = (program.out_info[0].logits, *sampling_arrays(padding), runner.no_tokens)
        more = (runner.processors, padding.processor_slots, padding.penalties)
        outputs = jax.tree_util.tree_structure(StepOutputs(0, 0, 0, 0))
        variants = {  # processed or not: (jitted, name, inputs, output tree)
            False: (jitted_sampler, f"{module}.sample_step", inputs, outputs),
            True: (
                jitted_processed_sampler,
                f"{module}.processed_sample_step",
                inputs + more,
                jax.tree_util.tree_structure((StepOutputs(0, 0, 0, 0), runner.processors)),
            ),
        }
        for sampler in SAMPLERS:
            for logprobs in sorted({0, runner.config.max_logprobs}):
                static = {"sampler": sampler, "num_logprobs": logprobs, "mesh": runner.mesh}
                for processed, (jitted, name, args, out) in variants.items():
                    key = (layout.samples, sampler, logprobs, processed)
                    with self.lock:
                        if key not in self.samplers and key not in runner._samplers:
                            self.samplers[key] = self._submit((jitted, name, args, static, out))

    def add_slot_starts(self) -> None:
        """Submit the slot writes of every prompt bucket not made yet."""
        runner = self.runner
        state, k = runner.processors, runner.config.max_biased_tokens
        vocab = runner.model_config.vocab_size
        row = (np.zeros(k, np.int32), np.zeros(k, np.float32), np.zeros(k, np.int32))
        for bucket in processors.prompt_buckets(runner.config.max_model_len, vocab):
            if bucket in runner._slot_starts or bucket in self.starts:
                continue
            ids = np.zeros(bucket, np.int32)
            self.starts[bucket] = self._submit(
                (
                    processors.jitted_start_slot,
                    f"{processors.__name__}.start_slot",
                    (state, np.int32(0), ids, ids, *row),
                    {},
                    jax.tree_util.tree_structure(state),
                )
            )

    def wait(self) -> None:
        """Every submitted program made, stored in the runner."""
        with self.lock:
            samplers, starts = dict(self.samplers), dict(self.starts)
        self.runner._samplers.update({k: f.result() for k, f in samplers.items()})
        self.runner._slot_starts.update({k: f.result() for k, f in starts.items()})
