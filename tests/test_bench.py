"""The main job (``python -m jax_tokenweave.bench``) and its helpers: timing, runs, device set-up
without import side effects, and the command lines of every benchmark script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from testutil import load_benchmark

from jax_tokenweave.harness import benchmarking as bm
from jax_tokenweave.harness import job, report, timing
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
    calls.clear()  # ahead: each sample dispatches that many runs before it waits
    stats = timing.benchmark(fns, warmup=0, iters=2, ahead=3)
    assert calls == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    assert all(len(s.samples_ms) == 2 for s in stats.values())


def test_time_once_reports_ms_per_run_of_a_dispatched_group():
    def slow():
        time.sleep(0.004)
        return np.zeros(1)

    assert 4.0 <= timing.time_once(slow, ahead=3) < 12.0  # 12 ms for 3 runs, 4 ms a run


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"warmup": -1}, "warmup"), ({"iters": 0}, "iters"), ({"ahead": 0}, "ahead")],
)
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
        "e2e_bench": load_benchmark("e2e_bench").build_parser(),
        "tune": load_benchmark("tune").build_parser(),
        "breakdown": load_benchmark("breakdown").build_parser(),
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

    e2e = load_benchmark("e2e_bench")
    assert {a.dest: a.choices for a in job.build_parser()._actions}["collective"] == bm.COLLECTIVES
    # prefill modes in the main job's words; decode adds the token-sharded ablation ffi-sync
    for table, words in ((e2e.MODES, bm.COLLECTIVES), (e2e.DECODE_MODES, ALL_COLLECTIVES)):
        for name, mode in table.items():
            assert name == mode.name and mode.schedule in bm.SCHEDULES and mode.collective in words
            schedule, *rest = name.split("-")
            assert schedule in bm.SCHEDULES and (not rest or rest[0] in bm.COLLECTIVES)
    assert set(e2e.MODES) == {"baseline", "weave-ffi-nosplit", "weave-xla", "weave-ffi", "nocomm"}

    breakdown = load_benchmark("breakdown")
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

    e2e = load_benchmark("e2e_bench")
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
        "from jax_tokenweave.harness import job; sys.exit(job.main(sys.argv[1:]))"
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
