"""How long the serving engine's jitted step takes to *return* (dispatch) against its total
time, batch 1: whether the host waits for the GPU inside the call.

Builds the model of ``decode_bench.py`` (default Llama-3-8B shapes, random weights), serves one
request of ``--context`` tokens to its decode steps, then dispatches the same packed decode
step 8 times with NumPy inputs and 8 times with inputs already on the device, printing the
median time to return and to finish. Rerun with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=``
and other flags to compare (the step's own compiler options apply on top). Usage::

    python benchmarks/step_dispatch.py [decode_bench options, e.g. --model tiny]
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import time
from pathlib import Path

import jax
import numpy as np


def main(argv: list[str]) -> None:
    spec = importlib.util.spec_from_file_location(
        "_decode_bench", Path(__file__).with_name("decode_bench.py")
    )
    db = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = db
    spec.loader.exec_module(db)
    from jax_tokenweave.serving import LLMEngine, SamplingParams

    a = db.resolve(
        db.parse_args(["--out", "/tmp/step_dispatch", "--batch", "1", "--no-plot", *argv]),
        jax.devices()[0].platform,
    )
    context = a.context[0]
    model = db.build_model(a, jax.devices()[:1])
    cfg = dataclasses.replace(db.engine_config(a, 1, context + 200), async_scheduling=False)
    engine = LLMEngine(model, cfg)
    vocab = model.config.vocab_size
    engine.add_request(
        [i % vocab for i in range(1, context + 1)],
        SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True),
    )
    for _ in range(10):
        engine.step()
    runner = engine.runner
    layout, arrays = runner.pack(engine.scheduler.schedule())
    for variant in ("numpy inputs", "device inputs"):
        times = []
        for _ in range(8):
            step_in = (
                arrays
                if variant == "numpy inputs"
                else jax.block_until_ready(jax.device_put(arrays))
            )
            t0 = time.perf_counter()
            out = runner.run(layout, step_in)
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            times.append((t1 - t0, time.perf_counter() - t0))
        ret, total = np.median(np.array(times), axis=0) * 1e3
        print(f"{variant}: returns after {ret:.2f} ms, done after {total:.2f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
