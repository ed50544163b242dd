"""The kernel benchmark and its policy writer: the size table ``auto`` reads is made from
measurements (benchmarks/kernel_bench.py --write-policy, benchmarks/policy_table.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from jax_tokenweave.kernel.policy import KernelPolicy, PolicyRow

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def kernel_bench():
    return _load("kernel_bench")


@pytest.fixture(scope="module")
def policy_table():
    return _load("policy_table")


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


def test_policy_from_rows_takes_the_fastest_per_size(policy_table):
    """Times at least 20% apart at every size, so the 5% tie rule never keeps the choice of
    the size before."""
    rng = np.random.default_rng()
    rows = []
    fastest = {}
    for tokens in (1, 16, 128, 1024):
        times = iter(float(10 * 1.2**k) for k in rng.permutation(6))
        for algo in ("one_shot", "direct"):
            for ctas in (8, 16, 32):
                t = next(times)
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
    policy = policy_table.policy_from_rows(rows, meta)
    assert isinstance(policy, KernelPolicy) and set(policy.by_ranks) == {2}
    for tokens, (algo, ctas, _) in fastest.items():
        row = policy.choose(2, tokens * 8192 * 2)
        assert (row.algo, row.num_ctas) == (algo, ctas)
    assert policy.choose(2, 10**12).algo == fastest[1024][0]  # the largest covers the rest
    assert "abc" in policy.meta["source"]


def test_policy_uses_wall_time_without_device_time(policy_table):
    rows = [_row(4, 1, "one_shot", 8, us=5.0), _row(4, 1, "direct", 8, us=9.0)]
    meta = dict(device="H200", n_devices=4, date="2026-11-23T00:00:00", commit="x", argv="")
    assert policy_table.policy_from_rows(rows, meta).choose(4, 1).algo == "one_shot"


def test_policy_names_what_ran_not_auto(policy_table, kernel_bench):
    """Rows asked for ``auto`` and the policy's count record what ran; the table written
    from them holds that variant and count (a table row of ``auto`` or no count is no policy)."""
    slow = _row(2, 16, "auto", None, us=9.0) | dict(ran_algo="one_shot", ran_ctas=64)
    fast = _row(2, 16, "auto", 32, us=7.0) | dict(ran_algo="one_shot", ran_ctas=32)
    big = _row(2, 4096, "auto", None, us=300.0) | dict(ran_algo="direct", ran_ctas=16)
    meta = dict(device="H200", n_devices=2, date="2026-11-26T00:00:00", commit="x", argv="")
    policy = policy_table.policy_from_rows([slow, fast, big], meta)
    small_row, large_row = policy.choose(2, 16 * 8192 * 2), policy.choose(2, 10**9)
    assert (small_row.algo, small_row.num_ctas) == ("one_shot", 32)
    assert (large_row.algo, large_row.num_ctas) == ("direct", 16)
    assert kernel_bench._shown(slow) == ("policy (64)", "auto (one_shot)")
    assert kernel_bench._shown(_row(2, 1, "direct", 8, us=1.0)) == ("8", "direct")


def test_policy_merges_sizes_with_one_choice(policy_table):
    """Sizes whose fastest row is the same (variant, CTAs) share one table row."""
    rows = [
        _row(2, 1, "one_shot", 64, us=5.0),
        _row(2, 16, "one_shot", 64, us=6.0),
        _row(2, 16, "direct", 32, us=9.0),
        _row(2, 256, "direct", 32, us=27.0),
        _row(2, 256, "one_shot", 64, us=31.0),
        _row(2, 4096, "direct", 32, us=250.0),
    ]
    meta = dict(device="H200", n_devices=2, date="2026-11-26T00:00:00", commit="x", argv="")
    got = policy_table.policy_from_rows(rows, meta).by_ranks[2]
    assert [(r.max_bytes, r.algo, r.num_ctas) for r in got] == [
        (16 * 8192 * 2, "one_shot", 64),
        (None, "direct", 32),
    ]


def test_write_keeps_group_sizes_it_did_not_measure(policy_table, tmp_path):
    """Rows of TP 2 and 4 (run on different machines, two files) replace those degrees of the
    table at --out; TP 8, measured in neither, keeps its rows."""
    import json

    out = tmp_path / "policy.json"
    before = KernelPolicy(
        {
            2: (PolicyRow(None, "direct", 16),),
            8: (PolicyRow(65536, "one_shot", 16), PolicyRow(None, "direct", 16)),
        },
        {"source": "old runs"},
    )
    before.save(out)
    files = []
    for tp, algo in ((2, "one_shot"), (4, "direct")):
        meta = dict(device="H200", n_devices=tp, date="2026-11-26T01:00:00", commit=f"c{tp}")
        meta["argv"] = f"kernel_bench.py --tp {tp}"
        rows = [_row(tp, 1, algo, 32, us=5.0, device_us=4.0), _row(tp, 1, "auto", 8, us=9.0)]
        files.append(tmp_path / f"tp{tp}.json")
        files[-1].write_text(json.dumps(dict(meta=meta, rows=rows)))
    argv, sys.argv = sys.argv, ["policy_table.py", *map(str, files), "--out", str(out)]
    try:
        policy_table.main()
    finally:
        sys.argv = argv
    after = KernelPolicy.from_json(json.loads(out.read_text()))
    assert after.by_ranks[2] == (PolicyRow(None, "one_shot", 32),)
    assert after.by_ranks[4] == (PolicyRow(None, "direct", 32),)
    assert after.by_ranks[8] == before.by_ranks[8]
    assert "c2, c4" in after.meta["source"] and "old runs" in after.meta["source"]
    assert after.meta["sources"]["8"] == "old runs"
    # A second write keeps TP 8's own source, not the whole previous source line again.
    policy_table.write(rows, dict(meta, commit="c9"), out)
    again = KernelPolicy.from_json(json.loads(out.read_text()))
    assert again.meta["sources"]["8"] == "old runs"
    assert again.meta["sources"]["2"] == after.meta["sources"]["2"]
    assert "c9" in again.meta["sources"]["4"] and again.meta["source"].count("old runs") == 1


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
