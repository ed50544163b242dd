"""The sweep scripts: ``e2e_bench.py`` (its runs, skips and time budget), ``tune.py``,
``breakdown.py``, and how ``harness.modes`` checks a mode against baseline or float32."""

from __future__ import annotations

import json

import numpy as np
import pytest
from testutil import load_benchmark

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.kernel import unavailable_reason

# ------------------------------------------------------------------------------ e2e bench ---


@pytest.mark.slow
def test_e2e_bench_runs_and_skips_unavailable_modes(tmp_path):
    e2e = load_benchmark("e2e_bench")
    argv = [
        "--out",
        str(tmp_path),
        "--models",
        "tiny",
        "--layers",
        "1",
        "--tp",
        "2",
        "16",
        "--tokens",
        "64",
        "--request-len",
        "40",
        "--decode-tokens",
        "4",
        "--warmup",
        "0",
        "--iters",
        "1",
        "--device-time",
        "1",
    ]
    assert e2e.main(argv) == 0
    report = json.loads((tmp_path / "e2e.json").read_text())
    recs = {(r["kind"], r["tp"], r["tokens"], r["mode"]): r for r in report["records"]}
    assert len(recs) == len(e2e.MODES) * 2 + len(e2e.DECODE_MODES) * 2
    ffi_ok = (
        unavailable_reason(
            bm.make_mesh(bm.platform_devices()[1], 2), "tp", bm.DTYPES["bfloat16"], (64, 64)
        )
        is None
    )
    for mode in ("baseline", "weave-xla", "nocomm"):
        assert recs[("prefill", 2, 64, mode)]["status"] == "ok", recs[("prefill", 2, 64, mode)]
        assert recs[("decode", 2, 4, mode)]["status"] == "ok", recs[("decode", 2, 4, mode)]
    if not ffi_ok:
        for mode in ("weave-ffi", "weave-ffi-nosplit"):
            r = recs[("prefill", 2, 64, mode)]
            assert r["status"] == "skipped" and "ffi unavailable" in r["reason"]
    assert recs[("decode", 2, 4, "baseline")]["status"] == "ok"
    assert recs[("prefill", 16, 64, "baseline")]["status"] == "skipped"
    assert "needs 16 devices" in recs[("prefill", 16, 64, "baseline")]["reason"]
    markdown = (tmp_path / "e2e.md").read_text()
    assert "## prefill: tiny, TP=2" in markdown and "weave-xla ms" in markdown
    # No CUDA GPU for the profiler here: the device table says so instead of staying silent.
    why = recs[("decode", 2, 4, "baseline")].get("device_reason")
    assert "device_ms" in recs[("decode", 2, 4, "baseline")] or why in markdown
    assert (tmp_path / "e2e.png").stat().st_size > 0


def test_e2e_bench_time_budget_and_bad_args(tmp_path, capsys):
    e2e = load_benchmark("e2e_bench")
    with pytest.raises(SystemExit):
        e2e.main(["--out", str(tmp_path), "--models", "nope"])
    assert "unknown model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.main(["--out", str(tmp_path), "--time-budget", "0"])
    assert "--time-budget: 0.0 must be > 0" in capsys.readouterr().err
    assert (
        e2e.main(
            [
                "--out",
                str(tmp_path),
                "--models",
                "tiny",
                "--tp",
                "2",
                "--tokens",
                "64",
                "--decode-tokens",
                "4",
                "--time-budget",
                "1e-9",
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert report["records"] and all(
        r["status"] == "skipped" and "time budget" in r["reason"] for r in report["records"]
    )


# ------------------------------------------------------------------------------- tune.py ---


def test_tune_decides_entries_and_threshold():
    """The tuner's rule: each token count's fastest candidate, the best split's offset, and the
    threshold from which the split wins at every larger count."""
    from jax_tokenweave.weave.tuning import TuneEntry

    tune = load_benchmark("tune")
    times = {
        1024: {(False, 0, 32): 10.0, (False, 0, None): 11.0, (True, 0, 16): 10.5},
        2048: {(False, 0, 32): 20.0, (True, 128, 16): 19.0, (True, 0, 16): 19.5},  # split wins
        4096: {(False, 0, 32): 40.0, (True, 0, 32): 41.0, (True, -128, 16): 40.5},  # loses
        8192: {(False, 0, 32): 80.0, (True, 0, 16): 76.0},
        16384: {(False, 0, 32): 160.0, (True, 256, 8): 150.0},
    }
    entries, threshold = tune.decide(times, 1024)
    assert threshold == 8192  # 2048 won, but 4096 lost again
    assert entries[1024] == TuneEntry(None, 32) and entries[2048] == TuneEntry(128, 16)
    assert entries[4096] == TuneEntry(-128, 32)  # unsplit CTAs, the best split's offset
    assert entries[16384] == TuneEntry(256, 8)
    assert tune.decide({t: times[t] for t in (8192, 16384)}, 1024)[1] == 1024  # wins all
    assert tune.decide({t: times[t] for t in (8192, 16384)}, 9000)[1] == 8192
    assert tune.decide({1024: times[1024]}, 512)[1] == 1025  # never wins
    by_algo = {8192: {(False, 0, 32, "direct"): 80.0, (True, 0, 16, "ce"): 74.0}}
    assert tune.decide(by_algo, 1024)[0][8192] == TuneEntry(None, 16, algo="ce")


def test_tune_skips_without_gpus(capsys):
    tune = load_benchmark("tune")
    if bm.platform_devices()[0] == "gpu":
        pytest.skip("GPUs present: tune.py would run")
    assert tune.main(["--model", "tiny", "--tp", "2"]) == 0
    assert "skipped: no CUDA GPUs" in capsys.readouterr().out


# ---------------------------------------------------------------------------- breakdown.py ---


@pytest.mark.slow
def test_breakdown_runs_on_cpu(tmp_path, capsys):
    """The breakdown on 8 virtual CPU devices: every mode that can run here is measured and the
    model-computing ones checked; the fused kernel's modes are skipped saying why."""
    breakdown = load_benchmark("breakdown")
    argv = [
        "--out",
        str(tmp_path),
        "--layers",
        "1",
        "--tp",
        "2",
        "--tokens",
        "96",
        "--request-len",
        "40",
        "--warmup",
        "0",
        "--iters",
        "2",
        "--ctas",
        "8",
        "--seed",
        "3",
    ]
    assert breakdown.main(argv) == 0
    report = json.loads((tmp_path / "breakdown.json").read_text())
    assert report["config"]["model"] == "tiny" and report["config"]["tp"] == 2
    (row,) = report["rows"]
    cells = row["modes"]
    assert set(cells) == set(breakdown.MODES) | {"weave-ffi@8"}
    ffi_ok = (
        unavailable_reason(
            bm.make_mesh(bm.platform_devices()[1], 2), "tp", bm.DTYPES["bfloat16"], (96, 64)
        )
        is None
    )
    for name in ("baseline", "nocomm", "weave-local", "weave-xla", "weave-auto"):
        assert cells[name]["status"] == "ok", cells[name]
        assert cells[name]["median_ms"] > 0 and cells[name]["iters"] == 2
    for name in ("weave-local", "weave-xla"):
        assert cells[name]["split"] and sum(cells[name]["half_lengths"]) == 96
    assert cells["weave-xla"]["rel_err"] <= report["config"]["tolerance"]
    assert "rel_err" not in cells["weave-local"] and "rel_err" not in cells["nocomm"]
    if not ffi_ok:
        for name in ("weave-ffi", "weave-ffi-sync", "weave-ffi@8"):
            assert cells[name]["status"] == "skipped" and "ffi unavailable" in cells[name]["reason"]
    d = row["derived"]
    want = cells["weave-local"]["median_ms"] - cells["nocomm"]["median_ms"]
    assert d["split_cost_ms"] == pytest.approx(want)
    assert d["weave_auto_over_baseline"] == pytest.approx(
        cells["weave-auto"]["median_ms"] / cells["baseline"]["median_ms"]
    )
    markdown = (tmp_path / "breakdown.md").read_text()
    assert "| tokens | baseline | nocomm | weave-local |" in markdown
    assert "split cost ms" in markdown
    assert (tmp_path / "breakdown.png").stat().st_size > 0
    assert bm.CPU_NOTE in capsys.readouterr().out


def test_breakdown_derived_columns():
    breakdown = load_benchmark("breakdown")
    ok = lambda ms: {"status": "ok", "median_ms": ms}
    cell = {
        "baseline": ok(99.12),
        "nocomm": ok(90.27),
        "weave-local": ok(92.62),
        "weave-ffi-sync": ok(98.0),
        "weave-ffi": ok(95.63),
        "weave-auto": ok(95.63),
        "weave-xla": {"status": "skipped"},
    }
    d = breakdown.derived(cell)
    assert d["split_cost_ms"] == pytest.approx(2.35) and d["exposed_comm_ms"] == pytest.approx(3.01)
    assert d["overlap_gain_ms"] == pytest.approx(2.37)
    assert d["gap_recovered"] == pytest.approx((99.12 - 95.63) / (99.12 - 90.27))
    assert d["weave_ffi_over_nocomm"] == pytest.approx(95.63 / 90.27)
    assert breakdown.derived({"baseline": ok(1.0)})["gap_recovered"] is None


def test_moe_modes_are_checked_against_float32_not_bf16_baseline(rng):
    """With a float32 reference a mode may be as far from it as bf16 baseline is (times the
    margin); without one, the plain tolerance against baseline holds; a broken mode fails both."""
    from jax_tokenweave.harness import modes as modes_lib

    ref32 = rng.standard_normal((64, 32))

    def noise(scale):  # ref32 plus noise of relative norm ``scale``
        e = rng.standard_normal(ref32.shape)
        return ref32 + scale * np.linalg.norm(ref32) / np.linalg.norm(e) * e

    base = noise(0.06)  # bf16 baseline, 6% from float32 (an MoE's router flips)
    table = {
        "baseline": modes_lib.Mode("baseline"),
        "weave-xla": modes_lib.Mode("weave", "xla"),
        "weave-ffi": modes_lib.Mode("weave", "ffi"),
    }
    outs = {"baseline": base, "weave-xla": noise(0.07), "weave-ffi": noise(0.5)}

    def check(ref):
        fns = {n: (lambda o=o: o) for n, o in outs.items()}
        info = {n: {"status": "ok"} for n in outs}
        modes_lib._check(fns, info, table, 3e-2, ref)
        return info

    plain = check(None)  # both differ from bf16 baseline by > 3%
    assert [plain[n]["status"] for n in ("weave-xla", "weave-ffi")] == ["mismatch"] * 2
    info = check(ref32)
    assert 0.05 < info["baseline"]["rel_err_f32"] < 0.07
    assert info["weave-xla"]["status"] == "ok" and info["weave-xla"]["rel_err"] > 3e-2
    assert info["weave-ffi"]["status"] == "mismatch"
    assert "vs float32 (baseline's 0.0" in info["weave-ffi"]["reason"]
