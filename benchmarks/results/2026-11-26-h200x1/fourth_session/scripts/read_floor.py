"""How long a bare read of N bytes takes on this GPU (torch reductions and a copy), device time
from the torch profiler: the floor under a decode-attention call that reads the same K + V."""

import json
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

out = sys.argv[1]
dev = torch.device("cuda")
rows = {}
for mb in [16.8, 33.5, 67.1, 134.2, 268.4, 1073.7]:
    n = int(mb * 1e6 / 2) // 4096 * 4096
    x = torch.randn(n // 4096, 4096, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    ops = {
        "sum_rows": lambda x=x: x.sum(dim=-1, dtype=torch.float32),
        "amax_rows": lambda x=x: x.amax(dim=-1),
        "sum_all": lambda x=x: x.sum(dtype=torch.float32),
        "copy": lambda x=x, y=y: y.copy_(x),
    }
    for name, fn in ops.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        durs = [e.device_time for e in prof.events() if e.device_type.name == "CUDA"]
        # one or two kernels a call: group by call count
        per_call = sum(durs) / 20
        rows[f"{mb}MB/{name}"] = {
            "us": per_call,
            "kernels_per_call": len(durs) / 20,
            "median_kernel_us": statistics.median(durs),
            "gb_s": n * 2 / (per_call * 1e-6) / 1e9,
        }
        print(
            f"{mb:8.1f} MB {name:10s} {per_call:9.2f} us"
            f"  {rows[f'{mb}MB/{name}']['gb_s']:7.0f} GB/s"
            f"  ({len(durs) / 20:.0f} kernels/call)",
            flush=True,
        )
with open(out, "w") as f:
    json.dump(rows, f, indent=1)
