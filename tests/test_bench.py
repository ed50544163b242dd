"""The main job (``python -m jax_tokenweave.bench``), its helpers, the e2e driver and tune.py:
runs, device set-up without import side effects, and their command lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from testutil import load_benchmark

from jax_tokenweave.bench import benchmarking as bm
from jax_tokenweave.bench import job, report, timing
from jax_tokenweave.kernel import unavailable_reason

ROOT = Path(__file__).resolve().parents[1]
# Tiny settings: 1 layer, a batch of 96 tokens in requests of 40 (one request is cut by the
# split), forced to split by a low threshold.
TINY = [
    "--model",
    "tiny",
    "--layers",
    "1",
    "--request-len",
    "40",
    "--split-threshold",
    "32",
    "--warmup",
    "1",
    "--iters",
    "2",
    "--no-progress",
]


# ----------------------------------------------------------------------------------- timing ---


def test_stats_percentiles():
    s = timing.Stats((4.0, 1.0, 3.0, 2.0, 5.0))
    assert s.median_ms == 3.0 and s.min_ms == 1.0 and s.mean_ms == 3.0
    assert s.p10_ms == pytest.approx(1.4) and s.p90_ms == pytest.approx(4.6)
    summary = s.summary()
    assert summary["iters"] == 5 and summary["samples_ms"] == [4.0, 1.0, 3.0, 2.0, 5.0]
    assert "samples_ms" not in s.summary(samples=False)
    with pytest.raises(ValueError, match="at least one sample"):
        timing.Stats(())


def test_benchmark_interleaves_and_counts_calls():
    calls: list[str] = []
    fns = {n: (lambda n=n: calls.append(n) or np.zeros(1)) for n in ("a", "b")}
    steps = []
    stats = timing.benchmark(fns, warmup=1, iters=3, on_step=lambda: steps.append(1))
    assert calls == ["a", "b"] + ["a", "b"] * 3
    assert len(steps) == 8
    assert set(stats) == {"a", "b"} and all(len(s.samples_ms) == 3 for s in stats.values())
    calls.clear()
    timing.benchmark(fns, warmup=0, iters=2, interleave=False)
    assert calls == ["a", "a", "b", "b"]


@pytest.mark.parametrize(("kwargs", "match"), [({"warmup": -1}, "warmup"), ({"iters": 0}, "iters")])
def test_benchmark_rejects_bad_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        timing.benchmark({"a": lambda: 0}, **kwargs)
    with pytest.raises(ValueError, match="empty"):
        timing.benchmark({})


def test_rel_error():
    ref = np.array([3.0, 4.0])
    assert timing.rel_error(ref, ref) == 0.0
    assert timing.rel_error(np.array([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert timing.rel_error(np.array([np.nan, 4.0]), ref) == float("inf")
    with pytest.raises(ValueError, match="shapes differ"):
        timing.rel_error(np.zeros(3), ref)


# ------------------------------------------------------------------------------- main job ---


def test_request_lengths():
    assert bm.request_lengths(96, 40) == (40, 40, 16)
    assert bm.request_lengths(80, 40) == (40, 40)
    assert bm.request_lengths(10, 40) == (10,)
    with pytest.raises(ValueError):
        bm.request_lengths(0, 40)


@pytest.mark.slow
def test_main_job_in_process(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert job.main([*TINY, "--tokens", "96,64", "--json", str(out), "--seed", "7"]) == 0
    text = capsys.readouterr().out
    assert "speedup weave" in text and "relative error" in text
    assert bm.CPU_NOTE in text  # CPU timings say nothing about GPU overlap
    report = json.loads(out.read_text())
    assert report["config"]["schedules"] == list(bm.SCHEDULES)
    assert report["config"]["tokens"] == [64, 96]
    assert report["config"]["seed"] == 7
    env = report["environment"]
    for key in ("device_kind", "jax_version", "date", "git_commit", "command"):
        assert key in env
    assert env["platform"] == "cpu"
    for result in report["results"]:
        assert result["split"] and sum(result["half_lengths"]) == result["tokens"]
        assert set(result["schedules"]) == {"baseline", "weave", "nocomm"}
        for stats in result["schedules"].values():
            assert stats["iters"] == 2 and stats["median_ms"] > 0
            assert stats["p10_ms"] <= stats["median_ms"] <= stats["p90_ms"]
        assert result["rel_err_weave_vs_baseline"] <= report["config"]["tolerance"]
        assert set(result["ratios"]) == {
            "baseline_over_weave",
            "baseline_over_nocomm",
            "weave_over_nocomm",
        }


def test_main_job_refuses_to_report_when_weave_disagrees(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(job.timing, "rel_error", lambda a, b: 0.5)
    out = tmp_path / "bench.json"
    assert (
        job.main([*TINY, "--tokens", "96", "--schedules", "baseline,weave", "--json", str(out)])
        == 1
    )
    assert "refusing to report" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_main_job_subprocess_uses_eight_cpu_devices(tmp_path):
    """As a newcomer runs it: a fresh process sets up the 8 virtual CPU devices itself."""
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jax_tokenweave.bench",
            *TINY,
            "--tokens",
            "96",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["environment"]["num_devices"] == bm.CPU_DEVICES
    assert report["config"]["tp"] == bm.CPU_DEVICES
    assert set(report["results"][0]["schedules"]) == set(bm.SCHEDULES)
    assert plot.stat().st_size > 0
    assert bm.CPU_NOTE in proc.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tokens", "0"], "must be >= 1"),
        (["--tokens", "abc"], "is not an integer"),
        (["--iters", "0"], "must be >= 1"),
        (["--warmup", "-1"], "must be >= 0"),
        (["--schedules", "fast"], "unknown schedule"),
        (["--collective", "nccl"], "invalid choice"),
        (["--dtype", "int8"], "invalid choice"),
        (["--tp", "64"], "needs 64 devices"),
        (["--tp", "3"], "not divisible"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--tol", "0"], "must be > 0"),
        (["--tol", "nan"], "must be > 0"),
        (["--collective", "ffi", "--tokens", "64"], "--collective ffi is unavailable"),
    ],
)
def test_argument_errors_are_clear(argv, message, capsys):
    if (
        "ffi" in argv
        and unavailable_reason(
            bm.make_mesh(bm.platform_devices()[1], 8), "tp", bm.DTYPES["bfloat16"], (64, 64)
        )
        is None
    ):
        pytest.skip("the fused kernel is available here")
    with pytest.raises(SystemExit) as exit_info:
        job.main(["--model", "tiny", *argv] if "--model" not in argv else argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_format_table_and_ratios():
    stats = {n: timing.Stats((t,)) for n, t in (("baseline", 2.0), ("weave", 1.6), ("nocomm", 1.5))}
    result = report.result(64, (64,), _FakePlan(), 1e-3, "xla", stats, {})
    assert result["ratios"]["baseline_over_weave"] == pytest.approx(1.25)
    table = report.format_table({"config": {"schedules": list(stats)}, "results": [result]})
    assert "1.250" in table and "weave/nocomm" in table and "30x34" in table


class _FakePlan:
    is_split = True
    offset = -2
    halves = (type("H", (), {"length": 30})(), type("H", (), {"length": 34})())


# ------------------------------------------------------------------------------ e2e bench ---


_load_script = load_benchmark


def _load_e2e():
    return _load_script("e2e_bench")


@pytest.mark.slow
def test_e2e_bench_runs_and_skips_unavailable_modes(tmp_path):
    e2e = _load_e2e()
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
    assert (tmp_path / "e2e.png").stat().st_size > 0


def test_e2e_bench_time_budget_and_bad_args(tmp_path, capsys):
    e2e = _load_e2e()
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


# -------------------------------------------------------------------------- command lines ---

SCRIPTS = {
    "bench": ["-m", "jax_tokenweave.bench"],
    "e2e_bench": ["benchmarks/e2e_bench.py"],
    "tune": ["benchmarks/tune.py"],
    "breakdown": ["benchmarks/breakdown.py"],
}


def _parsers():
    return {
        "bench": job.build_parser(),
        "e2e_bench": _load_script("e2e_bench").build_parser(),
        "tune": _load_script("tune").build_parser(),
        "breakdown": _load_script("breakdown").build_parser(),
    }


@pytest.mark.parametrize(
    ("script", "shown"),
    [
        ("bench", "(default: 2048 8192 on GPUs, 1024 2048 4096 on CPUs)"),
        ("e2e_bench", "(default: 2 4)"),
        ("tune", "(default: 1024 2048 4096 8192 16384)"),
        ("breakdown", "(default: 2048 4096 8192 16384 on GPUs, 128 256 on CPUs)"),
    ],
)
def test_help_shows_real_defaults(script, shown):
    from jax_tokenweave.models.configs import config_names

    proc = subprocess.run(
        [sys.executable, *SCRIPTS[script], "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = " ".join(proc.stdout.split())  # undo argparse's line wrapping
    assert "[[" not in text and "default: None" not in text and "default: False" not in text
    assert shown in text
    assert all(name in text for name in config_names())  # --model(s) lists the configs


def test_every_option_has_help_and_required_ones_no_default():
    for script, parser in _parsers().items():
        for action in parser._actions:
            assert action.help, (script, action.option_strings)
            if action.required:
                assert "default" not in parser.formatter_class("x")._get_help_string(action)


def test_modes_use_one_vocabulary():
    """The benchmarks name modes with the main job's words: schedule, then weave's comm."""
    from jax_tokenweave.weave.schedules import ALL_COLLECTIVES

    e2e = _load_script("e2e_bench")
    assert {a.dest: a.choices for a in job.build_parser()._actions}["collective"] == bm.COLLECTIVES
    # prefill modes in the main job's words; decode adds the token-sharded ablation ffi-sync
    for table, words in ((e2e.MODES, bm.COLLECTIVES), (e2e.DECODE_MODES, ALL_COLLECTIVES)):
        for name, mode in table.items():
            assert name == mode.name and mode.schedule in bm.SCHEDULES and mode.collective in words
            schedule, *rest = name.split("-")
            assert schedule in bm.SCHEDULES and (not rest or rest[0] in bm.COLLECTIVES)
    assert set(e2e.MODES) == {"baseline", "weave-ffi-nosplit", "weave-xla", "weave-ffi", "nocomm"}

    breakdown = _load_script("breakdown")
    for name, mode in breakdown.MODES.items():
        assert (
            name == mode.name
            and mode.schedule in bm.SCHEDULES
            and mode.collective in ALL_COLLECTIVES
        )
    assert set(breakdown.MODES) == {
        "baseline",
        "nocomm",
        "weave-local",
        "weave-ffi-sync",
        "weave-xla",
        "weave-ffi",
        "weave-auto",
    }
    assert set(e2e.DECODE_MODES) == {
        "baseline",
        "weave-ffi",
        "weave-ffi-sync",
        "weave-xla",
        "nocomm",
    }


def test_plot_without_matplotlib_fails_before_the_run(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    monkeypatch.setattr(job, "run", lambda *a: pytest.fail("ran without matplotlib"))
    with pytest.raises(SystemExit) as exit_info:
        job.main([*TINY, "--plot", str(tmp_path / "p.png")])
    assert exit_info.value.code == 2
    assert "pip install 'jax-tokenweave[plot]'" in capsys.readouterr().err

    e2e = _load_script("e2e_bench")
    argv = [
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
    with pytest.raises(SystemExit):
        e2e.main(argv)
    err = capsys.readouterr().err
    assert "jax-tokenweave[plot]" in err and "--no-plot" in err
    assert not (tmp_path / "e2e.json").exists()
    assert e2e.main([*argv, "--no-plot"]) == 0
    assert (tmp_path / "e2e.json").exists() and not (tmp_path / "e2e.png").exists()


@pytest.mark.slow
def test_cpu_devices_when_jax_started_first(tmp_path):
    """The main job called after JAX started (with its default of one CPU device): it says so,
    and runs on the device there is."""
    out = tmp_path / "bench.json"
    script = (
        "import sys, jax; jax.devices()\n"
        "from jax_tokenweave.bench import job; sys.exit(job.main(sys.argv[1:]))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", script, *TINY, "--tokens", "96", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "started before 8 virtual CPU devices" in proc.stderr
    assert "the 1 CPU device(s)" in proc.stderr
    assert json.loads(out.read_text())["config"]["tp"] == 1


def test_use_cpu_devices_keeps_the_users_choice(monkeypatch):
    """conftest chose the device count with the XLA flag: the helper changes nothing."""
    import jax

    assert "--xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    monkeypatch.setattr(jax.config, "update", lambda *a: pytest.fail("changed JAX's config"))
    assert bm.use_cpu_devices(bm.CPU_DEVICES) is None


# ------------------------------------------------------------------------------- tune.py ---


def test_tune_decides_entries_and_threshold():
    """The tuner's rule: each token count's fastest candidate, the best split's offset, and the
    threshold from which the split wins at every larger count."""
    from jax_tokenweave.weave.tuning import TuneEntry

    tune = _load_script("tune")
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


def test_tune_skips_without_gpus(capsys):
    tune = _load_script("tune")
    if bm.platform_devices()[0] == "gpu":
        pytest.skip("GPUs present: tune.py would run")
    assert tune.main(["--model", "tiny", "--tp", "2"]) == 0
    assert "skipped: no CUDA GPUs" in capsys.readouterr().out


# ---------------------------------------------------------------------------- breakdown.py ---


@pytest.mark.slow
def test_breakdown_runs_on_cpu(tmp_path, capsys):
    """The breakdown on 8 virtual CPU devices: every mode that can run here is measured and the
    model-computing ones checked; the fused kernel's modes are skipped saying why."""
    breakdown = _load_script("breakdown")
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
    breakdown = _load_script("breakdown")
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
    from jax_tokenweave.bench import modes as modes_lib

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
