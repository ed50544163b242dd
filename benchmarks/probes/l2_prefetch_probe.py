"""Probe (GPU): can a decode collective's wait pull the next GEMM's weights into L2?

At decode sizes a TP step alternates memory-bound GEMMs with all-reduces that mostly wait on
the NVLink round trip (4-8 us on 4 x H200), while HBM sits idle. If the fused kernel prefetched
the first bytes of the next GEMM's weights into L2 during that wait, the GEMM would read them
from L2 and end sooner, hiding part of the collective. This tests that premise on one GPU with
no collective: a kernel that spins for ``--wait-us`` (the collective's wait) while its threads
issue ``prefetch.global.L2::evict_last`` over the first P MiB of a weight ``W`` [K, N] (bf16,
row-major, as the model stores it; every GEMM tile starts at k = 0, the start of the buffer),
then ``x @ W`` (torch, cuBLAS) on the same stream. L2 is flushed before every pair.

Per (M, P): the median over ``--reps`` of the pair's time (CUDA events), the GEMM alone after a
plain spin, and the time saved against P = 0. If lines survive, a pair should shrink by about
P / (HBM bandwidth) up to the wait. Run: ``python3 -P benchmarks/probes/l2_prefetch_probe.py``
(needs torch with CUDA and nvcc: the spin kernel is built with ``load_inline``; writes
``--out`` JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

CUDA = r"""
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

__global__ void spin_prefetch(const char* w, long long bytes, long long wait_ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  const long long lines = bytes / 128, step = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < lines; i += step)
    asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(w + i * 128));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while ((long long)(now - start) < wait_ns);
}

void spin(torch::Tensor w, int64_t bytes, int64_t wait_ns, int64_t ctas) {
  TORCH_CHECK(w.is_cuda() && bytes <= w.numel() * w.element_size(), "bytes past the weight");
  spin_prefetch<<<ctas, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const char*>(w.data_ptr()), bytes, wait_ns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=8192, help="GEMM K (the hidden size)")
    ap.add_argument("--n", type=int, default=14336, help="GEMM N (gate/up of Llama-70B at TP 4)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64], help="GEMM M (batch)")
    ap.add_argument("--mib", type=int, nargs="+", default=[0, 8, 16, 32, 48], help="P, MiB")
    ap.add_argument("--wait-us", type=float, default=6.0, help="the spin: a collective's wait")
    ap.add_argument("--ctas", type=int, default=16, help="CTAs of the spin kernel (256 threads)")
    ap.add_argument("--reps", type=int, default=50, help="timed pairs per point")
    ap.add_argument("--out", type=Path, default=Path("l2_prefetch_probe.json"))
    args = ap.parse_args()

    import torch
    from torch.utils.cpp_extension import load_inline

    torch.manual_seed(0)
    dev = torch.device("cuda")
    stream = torch.cuda.current_stream()
    ext = load_inline(
        "l2_prefetch_probe",
        cpp_sources="void spin(torch::Tensor w, int64_t bytes, int64_t wait_ns, int64_t ctas);",
        cuda_sources=CUDA,
        functions=["spin"],
        extra_cuda_cflags=["-O3", "-arch=sm_90a"],
    )
    w = torch.randn(args.k, args.n, device=dev, dtype=torch.bfloat16)
    flush = torch.empty(256 << 20, device=dev, dtype=torch.uint8)  # larger than any L2
    assert max(args.mib) << 20 <= w.numel() * 2, "P is larger than the weight"

    def pair(x: torch.Tensor, mib: int, wait_us: float) -> float:
        flush.fill_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        ext.spin(w, mib << 20, int(wait_us * 1e3), args.ctas)
        x @ w
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) * 1e3  # us

    rows = []
    for m in args.rows:
        x = torch.randn(m, args.k, device=dev, dtype=torch.bfloat16)
        for _ in range(5):  # warm: cuBLAS handles, the kernel's module
            pair(x, 0, args.wait_us)
        alone = statistics.median(pair(x, 0, 0.0) for _ in range(args.reps))
        base = None
        for mib in args.mib:
            us = statistics.median(pair(x, mib, args.wait_us) for _ in range(args.reps))
            base = us if mib == 0 else base
            rows.append(dict(m=m, mib=mib, pair_us=us, gemm_after_spin0_us=alone))
            saved = 0.0 if base is None else base - us
            print(
                f"M={m:4d} P={mib:3d} MiB: pair {us:8.1f} us (saved {saved:6.1f}); "
                f"GEMM + empty spin {alone:8.1f} us",
                flush=True,
            )
    meta = dict(
        device=torch.cuda.get_device_name(),
        k=args.k,
        n=args.n,
        wait_us=args.wait_us,
        ctas=args.ctas,
        reps=args.reps,
        weight_mib=w.numel() * 2 >> 20,
    )
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
