"""Memory-roofline helpers shared by ``attention_bench.py``, ``decode_bench.py`` and
``prefill_bench.py``: the device's bandwidth measured by a device-to-device copy, the bytes and
FLOPs of an attention case, the bytes a decode step must move.

The benchmarks load this file by path (registered in ``sys.modules`` as
``_benchmarks_roofline``), so that it is found under ``python -P`` (which keeps the script's
folder off ``sys.path``) as well.
"""

from __future__ import annotations

import dataclasses
from typing import Any

GB = 1e9


def copy_bandwidth(
    device: Any, nbytes: int, *, warmup: int = 3, iters: int = 10
) -> dict[str, float]:
    """The bandwidth of ``device``'s memory from a device-to-device copy of ``nbytes`` bytes.

    On a CUDA device with PyTorch at hand: ``torch.Tensor.copy_`` (a plain ``cudaMemcpy``, what
    the copy engines and the DRAM allow) timed with CUDA events; elsewhere a jitted
    ``jnp.copy`` timed by ``harness.timing.benchmark``. Median of ``iters`` copies after
    ``warmup``. Returns ``{"bytes", "median_ms", "gb_s", "method"}``; ``gb_s`` counts the bytes
    read and the bytes written (``2 * bytes / time``, in 1e9 B/s).
    """
    n = max(int(nbytes) // 4, 1)
    ms = _torch_copy_ms(device, n, warmup, iters)
    method = "torch copy_ (CUDA events)"
    if ms is None:
        import jax
        import jax.numpy as jnp

        from jax_tokenweave.harness import timing

        x = jax.jit(
            lambda: jnp.arange(n, dtype=jnp.float32),
            out_shardings=jax.sharding.SingleDeviceSharding(device),
        )()
        copy = jax.jit(jnp.copy)
        ms = timing.benchmark({"copy": lambda: copy(x)}, warmup=warmup, iters=iters)[
            "copy"
        ].median_ms
        method = "jitted jnp.copy (wall clock)"
    return {"bytes": 4 * n, "median_ms": ms, "gb_s": 2 * 4 * n / (ms * 1e-3) / GB, "method": method}


def _torch_event_ms(device: Any, make_run: Any, warmup: int, iters: int) -> float | None:
    """Median ms of ``run()``, ``run = make_run(torch)`` (None: not here), timed with CUDA
    events on ``device``'s GPU after ``warmup`` runs; None where PyTorch or its CUDA is missing
    or the device is not a CUDA GPU."""
    if getattr(device, "platform", None) not in ("gpu", "cuda"):
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    with torch.cuda.device(getattr(device, "local_hardware_id", None) or 0):
        run = make_run(torch)
        if run is None:
            return None
        times = []
        for i in range(warmup + iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end))
        del run
        torch.cuda.empty_cache()
    return float(sorted(times)[len(times) // 2])


def _torch_copy_ms(device: Any, n: int, warmup: int, iters: int) -> float | None:
    """Median ms of ``n``-float32 device-to-device copies through PyTorch (or None)."""

    def make_run(torch: Any) -> Any:
        src = torch.rand(n, device="cuda")
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)

    return _torch_event_ms(device, make_run, warmup, iters)


def matmul_rate(
    device: Any, dtype: Any, n: int = 8192, *, warmup: int = 3, iters: int = 10
) -> dict[str, Any]:
    """Dense matmul throughput of ``device``: an ``n x n x n`` product of ``dtype`` (through
    PyTorch with CUDA events where it can, else a jitted ``jnp.dot`` on the wall clock, with
    ``n`` cut to 1024). Median of ``iters`` after ``warmup``. Returns ``{"n", "median_ms",
    "tflop_s", "method"}``. On a GPU held to its power limit this is the capped rate, as the
    decode step's GEMMs get it."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    ms, method = _torch_matmul_ms(device, np.dtype(dtype).name, n, warmup, iters), "torch matmul"
    if ms is None:
        from jax_tokenweave.harness import timing

        n = min(n, 1024)
        place = jax.sharding.SingleDeviceSharding(device)
        a = jax.jit(lambda: jnp.ones((n, n), dtype), out_shardings=place)()
        dot = jax.jit(jnp.dot)
        ms = timing.benchmark({"dot": lambda: dot(a, a)}, warmup=warmup, iters=iters)[
            "dot"
        ].median_ms
        method = "jitted jnp.dot (wall clock)"
    return {"n": n, "median_ms": ms, "tflop_s": 2 * n**3 / (ms * 1e-3) / 1e12, "method": method}


def _torch_matmul_ms(device: Any, dtype: str, n: int, warmup: int, iters: int) -> float | None:
    """Median ms of an ``n``-cube matmul of ``dtype`` through PyTorch (or None)."""

    def make_run(torch: Any) -> Any:
        if not hasattr(torch, dtype):
            return None
        a = torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype))
        b = torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype))
        return lambda: torch.matmul(a, b)

    return _torch_event_ms(device, make_run, warmup, iters)


def projections(config: Any, tp: int) -> list[tuple[int, int]]:
    """``(K, N)`` of a decoder layer's GEMMs on one rank: QKV, O, gate/up, down (the fused
    layout, ``nn.decoder_layer``)."""
    h, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    nq, nkv = config.num_heads * d, config.num_kv_heads * d
    return [(h, (nq + 2 * nkv) // tp), (nq // tp, h), (h, 2 * f // tp), (f // tp, h)]


def serial_floor_ms(
    config: Any, tp: int, rows: int, kv: int, itemsize: int, gb_s: float, tflop_s: float
) -> float | None:
    """A decode step's floor with its parts one after another, as a layer's data dependences
    run them (QKV, then attention, then O, gate/up and down): every GEMM at the slower of
    reading its weights at ``gb_s`` and its ``2 * rows * K * N`` FLOPs at ``tflop_s``, the LM
    head likewise, and ``kv`` bytes of K/V at ``gb_s``. At batch 1 it is the bytes roofline
    (less norms and biases); at batch 256 the GEMMs are bound by FLOPs, not bytes. None for
    experts (their GEMMs depend on the routing)."""
    if config.num_experts:
        return None

    def gemm_s(k: int, n: int) -> float:
        return max(k * n * itemsize / (gb_s * GB), 2 * rows * k * n / (tflop_s * 1e12))

    layer = sum(gemm_s(k, n) for k, n in projections(config, tp))
    head = gemm_s(config.hidden_size, config.vocab_size // tp)
    return (config.num_layers * layer + head + kv / (gb_s * GB)) * 1e3


@dataclasses.dataclass(frozen=True)
class Case:
    """One measurement: ``decode`` (``batch`` rows at position ``context - 1``) or ``prefill``
    (one request's ``chunk`` rows at positions ``prefix ..``, tiles of ``tile``)."""

    kind: str
    batch: int = 1
    context: int = 0
    chunk: int = 0
    prefix: int = 0

    @property
    def requests(self) -> int:
        return self.batch if self.kind == "decode" else 1

    @property
    def keys(self) -> int:
        """Cached positions each request's attention reads."""
        return self.context if self.kind == "decode" else self.prefix + self.chunk

    @property
    def rows(self) -> int:
        return self.batch if self.kind == "decode" else self.chunk

    @property
    def pairs(self) -> int:
        """Visible query-key pairs (causal)."""
        if self.kind == "decode":
            return self.batch * self.context
        return self.chunk * self.prefix + self.chunk * (self.chunk + 1) // 2


def moved_bytes(case: Case, heads: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """K and V read once per request and kv head, q read and out written once."""
    kv = kv_bytes(case.requests * case.keys, kv_heads, head_dim, itemsize)
    return kv + 2 * case.rows * heads * head_dim * itemsize


def attention_flops(case: Case, heads: int, head_dim: int) -> int:
    """``4 * D`` FLOPs per visible query-key pair and query head (QK^T and PV)."""
    return 4 * head_dim * heads * case.pairs


def kv_bytes(keys: int, kv_heads: int, head_dim: int, itemsize: int, layers: int = 1) -> int:
    """Bytes of K and V read for ``keys`` cached positions (summed over requests), every layer:
    ``keys * kv_heads * head_dim * itemsize * 2 (K and V) * layers``."""
    return keys * kv_heads * head_dim * itemsize * 2 * layers


def decode_step_bytes(
    weight_bytes: int,
    batch: int,
    context: int,
    kv_heads: int,
    head_dim: int,
    itemsize: int,
    layers: int,
) -> int:
    """Bytes a decode step of ``batch`` requests of ``context`` cached positions must move at
    least: every weight once (:func:`weight_bytes`) and every request's K/V of every layer."""
    return weight_bytes + kv_bytes(batch * context, kv_heads, head_dim, itemsize, layers)


def weight_bytes(model: Any, device: Any) -> int:
    """Bytes of ``model``'s parameters that ``device`` holds and a decode step reads: all of
    them but the embedding table (a decode step gathers a few rows of it), which is counted once
    as the LM head where the head is tied to it (``tie_word_embeddings``)."""
    from flax import nnx

    def on_device(x: Any) -> int:
        return sum(s.data.nbytes for s in x.addressable_shards if s.device == device)

    total = sum(on_device(leaf) for leaf in jax_leaves(nnx.state(model, nnx.Param)))
    if not model.config.tie_word_embeddings:
        total -= on_device(model.embed.get_value())
    return total


def jax_leaves(tree: Any) -> list[Any]:
    """The array leaves of a pytree (``nnx.State`` included)."""
    import jax

    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "addressable_shards")]


def add_decode_roofline(
    record: dict[str, Any], model: Any, weights: int, gb_s: float, tflop_s: float
) -> None:
    """A ``decode_bench`` record's bytes per step (``weights`` + the K/V of its ``mean_keys``),
    its roofline time at ``gb_s`` and ratio, and its serial floor (:func:`serial_floor_ms`)."""
    import numpy as np

    c = model.config
    itemsize = np.dtype(model.embed.get_value().dtype).itemsize
    kv = kv_bytes(
        round(record["mean_keys"]),
        c.num_kv_heads // model.mesh.size,
        c.head_dim,
        itemsize,
        c.num_layers,
    )
    record.update(
        weight_bytes=weights,
        kv_bytes=kv,
        bytes=weights + kv,
        roofline_ms=(weights + kv) / (gb_s * GB) * 1e3,
    )
    record["ratio"] = record["step_p50_ms"] / record["roofline_ms"]
    floor = serial_floor_ms(c, model.mesh.size, record["batch"], kv, itemsize, gb_s, tflop_s)
    record["floor_ms"] = floor
    record["floor_ratio"] = None if floor is None else record["step_p50_ms"] / floor
