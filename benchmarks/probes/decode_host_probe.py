"""Probe (GPU): where a decode step's wall time goes on the host, without cProfile's overhead.

Builds the engine as ``decode_bench.py`` does (same options), then per batch: the timed decode
steps with each host phase timed by ``perf_counter`` (schedule + pack + dispatch of step n+1,
the wait for step n's tokens, the update), and ``step_profile.profile_steps`` of a few steps
without cProfile: device busy time and the longest idle stretches with their neighbours.
Run: ``python3 -P benchmarks/probes/decode_host_probe.py --batch 64 256 --context 1024``
(``PROBE_VARIANT=no_prev`` or ``no_d2h``: see :func:`variant`).
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from jax_tokenweave.harness import benchmarking as bm

BENCH = Path(__file__).resolve().parents[1]


def _timing(inner: Any, label: str, spent: dict[str, list[float]]) -> Any:
    """``inner`` wrapped so each call's wall time (ms) lands in ``spent[label]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label].append((time.perf_counter() - t0) * 1e3)

    return wrapper


def timed(obj: Any, name: str, spent: dict[str, list[float]]) -> None:
    """Time each call of ``obj.name`` into ``spent[name]``."""
    setattr(obj, name, _timing(getattr(obj, name), name, spent))


def timed_value(table: dict, key: Any, label: str, spent: dict[str, list[float]]) -> None:
    """Time each call of the callable ``table[key]`` into ``spent[label]``."""
    table[key] = _timing(table[key], label, spent)


def timed_jit_path(runner: Any, spent: dict[str, list[float]]) -> None:
    """Time each dispatch of the forward through jit (the layout's jitted form, for layouts not
    warmed up) into ``spent["jitted_forward"]``."""
    jitted = runner._jitted
    runner._jitted = lambda layout: _timing(jitted(layout), "jitted_forward", spent)


def variant(engine: Any, name: str) -> None:
    """What may hold the next step's dispatch, taken away (the tokens go wrong; only the
    timing counts): "no_prev", decodes take no tokens from the step in flight; "no_d2h",
    no copy of the sampled tokens to the host is started at dispatch (fetch waits for it)."""
    runner = engine.runner
    dispatch = runner.dispatch
    if name == "no_prev":
        runner.dispatch = lambda scheduled, arrays, previous=None: dispatch(scheduled, arrays)
    elif name == "no_d2h":
        from jax_tokenweave.serving.runner.runner import InFlight

        def no_copy(scheduled: Any, arrays: Any, previous: Any = None) -> Any:
            layout, host = arrays
            prev = None if previous is None else previous.outputs.tokens
            outputs = runner.run(layout, host, prev)
            return InFlight(scheduled, layout, outputs, bool(host.want_logprobs))

        runner.dispatch = no_copy
    elif name != "default":
        raise SystemExit(f"PROBE_VARIANT must be default, no_prev or no_d2h, got {name!r}")


def main() -> None:
    db = bm.sibling_module(str(BENCH / "decode_bench.py"), "decode_bench")
    sp = bm.sibling_module(str(BENCH / "step_profile.py"), "step_profile")
    a = db.parse_args([*sys.argv[1:], "--out", "/tmp/decode_host_probe"])
    platform, devices = bm.start_devices(a.tp)
    a = db.resolve(a, platform)
    model = db.build_model(a, devices)
    from jax_tokenweave.serving import LLMEngine, SamplingParams

    rng = np.random.default_rng(0)
    for batch in a.batch:
        context = a.context[0]
        max_tokens = a.warm_steps + 40 + batch
        engine = LLMEngine(model, db.engine_config(a, batch, context + max_tokens))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for _ in range(batch):
            engine.add_request(rng.integers(0, model.config.vocab_size, context).tolist(), params)
        sched = engine.scheduler
        while sched.waiting or not all(s.prefilled for s in sched.running):
            engine.step()
        for _ in range(a.warm_steps):
            engine.step()
        spent: dict[str, list[float]] = collections.defaultdict(list)
        from jax_tokenweave.serving.runner import runner as runner_module

        variant(engine, os.environ.get("PROBE_VARIANT", "default"))

        for obj, name in (
            # run()'s parts: the input vector, the forward's dispatch (jit path; warmed-up
            # executables are timed by their dict below), the sampler's.
            (runner_module, "pack_inputs"),
            (runner_module, "sampling_arrays"),
            (runner_module, "jitted_sampler"),
            (engine, "_dispatch_next"),
            (engine, "_take_oldest"),
            (engine.runner, "pack"),
            (engine.runner, "run"),
            (engine.runner, "fetch"),
            (sched, "schedule"),
            (sched, "update"),
        ):
            timed(obj, name, spent)
        timed_jit_path(engine.runner, spent)
        for table, label in (
            (engine.runner._executables, "forward"),
            (engine.runner._samplers, "sampler"),
        ):
            for key in list(table):
                timed_value(table, key, label, spent)
        steps = []
        for _ in range(20):
            t0 = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - t0) * 1e3)
        phases = {k: round(statistics.median(v), 3) for k, v in spent.items()}
        prof = sp.profile_steps(engine.step, 4, top=8, host_profile=False)
        print(
            json.dumps(
                {
                    "batch": batch,
                    "step_ms": statistics.median(steps),
                    "phases": phases,
                    "profile": prof,
                },
                indent=1,
            )
        )
        del engine


if __name__ == "__main__":
    main()
