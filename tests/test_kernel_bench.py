"""The kernel benchmark's policy writer: the size table ``auto`` reads is made from
measurements (benchmarks/kernel_bench.py --write-policy)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from jax_tokenweave.kernel.policy import KernelPolicy

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def kernel_bench():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("kernel_bench", BENCH / "kernel_bench.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def _row(tp, tokens, algo, ctas, us, device_us=None):
    r = dict(
        tp=tp,
        hidden=8192,
        tokens=tokens,
        impl="ffi",
        num_ctas=ctas,
        algo=algo,
        dtype="bfloat16",
        us=us,
    )
    if device_us is not None:
        r["device_us"] = device_us
    return r


def test_policy_from_rows_takes_the_fastest_per_size(kernel_bench):
    rng = np.random.default_rng()
    rows = []
    fastest = {}
    for tokens in (1, 16, 128, 1024):
        for algo in ("one_shot", "direct"):
            for ctas in (8, 16, 32):
                t = float(rng.uniform(1, 100))
                rows.append(_row(2, tokens, algo, ctas, us=1000.0, device_us=t))
                if tokens not in fastest or t < fastest[tokens][2]:
                    fastest[tokens] = (algo, ctas, t)
    rows.append(
        dict(
            tp=2,
            hidden=8192,
            tokens=16,
            impl="xla",
            num_ctas=None,
            algo=None,
            dtype="bfloat16",
            us=0.1,
        )
    )  # XLA rows never enter the table
    meta = dict(
        device="H200", n_devices=2, date="2026-11-23T00:00:00", commit="abc", argv="kernel_bench.py"
    )
    policy = kernel_bench.policy_from_rows(rows, meta)
    assert isinstance(policy, KernelPolicy) and set(policy.by_ranks) == {2}
    for tokens, (algo, ctas, _) in fastest.items():
        row = policy.choose(2, tokens * 8192 * 2)
        assert (row.algo, row.num_ctas) == (algo, ctas)
    assert policy.choose(2, 10**12).algo == fastest[1024][0]  # the largest covers the rest
    assert "abc" in policy.meta["source"]


def test_policy_uses_wall_time_without_device_time(kernel_bench):
    rows = [_row(4, 1, "one_shot", 8, us=5.0), _row(4, 1, "direct", 8, us=9.0)]
    meta = dict(device="H200", n_devices=4, date="2026-11-23T00:00:00", commit="x", argv="")
    assert kernel_bench.policy_from_rows(rows, meta).choose(4, 1).algo == "one_shot"


def test_policy_names_what_ran_not_auto(kernel_bench):
    """Rows asked for ``auto`` and the policy's count record what ran; the table written
    from them holds that variant and count (a table row of ``auto`` or no count is no policy)."""
    slow = _row(2, 16, "auto", None, us=9.0) | dict(ran_algo="one_shot", ran_ctas=64)
    fast = _row(2, 16, "auto", 32, us=7.0) | dict(ran_algo="one_shot", ran_ctas=32)
    big = _row(2, 4096, "auto", None, us=300.0) | dict(ran_algo="direct", ran_ctas=16)
    meta = dict(device="H200", n_devices=2, date="2026-11-26T00:00:00", commit="x", argv="")
    policy = kernel_bench.policy_from_rows([slow, fast, big], meta)
    small_row, large_row = policy.choose(2, 16 * 8192 * 2), policy.choose(2, 10**9)
    assert (small_row.algo, small_row.num_ctas) == ("one_shot", 32)
    assert (large_row.algo, large_row.num_ctas) == ("direct", 16)
    assert kernel_bench._shown(slow) == ("policy (64)", "auto (one_shot)")
    assert kernel_bench._shown(_row(2, 1, "direct", 8, us=1.0)) == ("8", "direct")


def test_ctas_option(kernel_bench):
    assert [kernel_bench._ctas(v) for v in ("16", "policy")] == [16, None]
    for bad in ("0", "-3", "many"):
        with pytest.raises(Exception, match="positive integer or 'policy'"):
            kernel_bench._ctas(bad)


@pytest.mark.slow
def test_runs_with_one_process_per_device(tmp_path):
    """Under the launcher (two CPU processes, XLA's collectives over gloo) every process builds
    the same inputs and process 0 alone writes the results."""
    import json
    import os
    import subprocess

    env = dict(os.environ, JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    out = tmp_path / "kb"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jax_tokenweave.launch",
            "-n",
            "2",
            "--cpu",
            "--timeout",
            "10",
            "--",
            sys.executable,
            str(BENCH / "kernel_bench.py"),
            "--out",
            str(out),
            "--tp",
            "2",
            "--hidden",
            "256",
            "--tokens",
            "4",
            "--impls",
            "xla",
            "xla_rsag",
            "--reps",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "kernel_bench.json").read_text())
    assert result["meta"]["processes"] == 2 and result["meta"]["n_devices"] == 2
    assert {r["impl"] for r in result["rows"]} == {"xla", "xla_rsag"}
    assert all(r["us"] > 0 for r in result["rows"])
