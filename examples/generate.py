"""Generate text from a Hugging Face checkpoint directory (Llama, Mistral, Qwen2, Mixtral).

    python examples/generate.py /path/to/checkpoint --tp 4 --prompt "The capital of France is"

Loads the checkpoint tensor-parallel over ``--tp`` devices (each device reads only its shard
of each tensor), then serves the prompts with ``jax_tokenweave.serving.Engine``: a weave
prefill (split in two halves when a batch has >= ``--weave-threshold`` tokens, by default the
tuning table's threshold) and fused decode steps. Text needs the tokenizer files in the
directory (``transformers`` installed); otherwise pass token ids with ``--ids 1,2,3``. On a
CPU-only host, ``--cpu-devices N`` fakes N devices.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="directory with config.json + *.safetensors")
    parser.add_argument("--prompt", action="append", default=[], help="text prompt (repeat)")
    parser.add_argument("--ids", action="append", default=[],
                        help="comma-separated token ids (repeat)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--schedule", default="weave", choices=["weave", "baseline"])
    parser.add_argument("--weave-threshold", type=int, default=None,
                        help="split prefills of at least this many tokens (default: the "
                             "tuning table's)")
    parser.add_argument("--cpu-devices", type=int, default=0,
                        help="fake this many CPU devices (set before JAX starts)")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from jax_tokenweave import from_pretrained
    from jax_tokenweave.serving import Engine, ServingConfig

    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # before JAX's first use

    tokenizer = None
    if args.prompt:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
        except (ImportError, OSError, ValueError) as e:
            parser.error(f"text prompts need a tokenizer in {args.checkpoint}: {e}")
    prompts = [tokenizer.encode(p) for p in args.prompt] if tokenizer else []
    prompts += [[int(t) for t in ids.split(",")] for ids in args.ids]
    if not prompts:
        parser.error("give at least one --prompt or --ids")

    devices = jax.devices()
    if len(devices) < args.tp:
        parser.error(f"--tp {args.tp} needs {args.tp} devices, have {len(devices)}")
    mesh = Mesh(np.array(devices[:args.tp]), ("tp",))
    start = time.perf_counter()
    model = from_pretrained(args.checkpoint, mesh, getattr(jnp, args.dtype))
    print(f"loaded {model.hf_info.model_type} in {time.perf_counter() - start:.1f}s "
          f"(TP {args.tp}, {args.dtype})", file=sys.stderr)

    engine = Engine(model, ServingConfig(
        max_batch=args.max_batch, max_seq_len=args.max_seq_len, schedule=args.schedule,
        weave_threshold=args.weave_threshold))
    start = time.perf_counter()
    outputs = engine.generate(prompts, args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed)
    seconds = time.perf_counter() - start
    for prompt, new in zip(prompts, outputs, strict=True):
        if tokenizer is not None:
            print(tokenizer.decode(prompt + new, skip_special_tokens=True))
        else:
            print(",".join(map(str, prompt)), "->", ",".join(map(str, new)))
    print(f"{sum(map(len, outputs))} tokens in {seconds:.2f}s (includes compilation)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
