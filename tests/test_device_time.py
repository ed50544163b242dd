"""Device time per GPU from profiled kernels (``benchmarks/step_profile.py``) and its table in
e2e_bench's report."""

from __future__ import annotations

import pytest
from testutil import load_benchmark


@pytest.fixture(scope="module")
def device_time():
    return load_benchmark("step_profile")


def test_per_device_busy_launches_and_classes(device_time):
    Kernel = device_time.Kernel
    name = "void tokenweave::(anonymous)::OneShotRowsKernel<bf16, 4, 256>(KernelParams)"
    kernels = [  # two runs on device 0, one kernel of run 1 on device 1
        Kernel(0, 0.0, 10.0, "nvjet_tst_128x64_gemm", 10.0),
        Kernel(0, 8.0, 14.0, name, 6.0),  # overlaps the GEMM by 2 us (a programmatic launch)
        Kernel(0, 20.0, 23.0, "loop_add_fusion", 3.0),
        Kernel(0, 30.0, 31.0, "ncclDevKernel_AllReduce_Sum_bf16", 1.0),
        Kernel(1, 0.0, 4.0, "input_reduce_fusion", 4.0),
    ]
    rows = device_time.per_device(kernels, iters=2)
    assert rows[0] == pytest.approx(
        {"busy": 9.0, "launches": 2.0, "gemm": 5.0, "fused": 3.0, "other": 1.5, "nccl": 0.5}
    )
    assert rows[1] == pytest.approx({"busy": 2.0, "launches": 0.5, "other": 2.0})
    assert device_time.kernel_class("OneShotRowsKernel") == "other"  # not this library's


def test_busy_ms_says_why_without_a_profiler(monkeypatch, device_time):
    monkeypatch.setattr(device_time, "unavailable_reason", lambda: "no CUDA GPU here")
    assert device_time.busy_ms(lambda: None, 3) == {"reason": "no CUDA GPU here"}


def test_e2e_report_puts_device_time_beside_wall_time():
    report_mod = load_benchmark("e2e_report")
    base = dict(kind="decode", model="tiny", tp=2, tokens=16, status="ok")
    records = [
        {**base, "mode": "baseline", "median_ms": 2.0, "device_ms": 1.2},
        {**base, "mode": "weave-ffi", "median_ms": 1.6, "device_ms": 1.0},
        {**base, "mode": "nocomm", "median_ms": 1.5, "device_reason": "no CUDA GPU"},
    ]
    env = dict(num_devices=2, device_kind="cpu", jax_version="0", git_commit="x", date="d")
    cfg = dict(layers=1, dtype="bfloat16", request_len=1, iters=3, warmup=1, device_time=5)
    text = report_mod.to_markdown(dict(environment=env, config=cfg, records=records))
    wall, device = text.split("device-busy ms per run")
    assert "| 16 | 2.00 | 1.60 | 1.50 | 1.250 | 1.333 |" in wall
    assert "| 16 | 1.20 | 1.00 | ok [1] | 1.200 | - |" in device
    assert "[1] no CUDA GPU" in device and "5 runs" in device
