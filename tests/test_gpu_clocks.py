"""``benchmarks/gpu_clocks.py``: nvidia-smi's samples parsed, summed up over a window, and a
record that says why where there is no nvidia-smi (a fake one on PATH stands in for the GPU)."""

from __future__ import annotations

import datetime as dt
import os
import stat
import time

import pytest
from testutil import load_benchmark


@pytest.fixture(scope="module")
def clocks():
    return load_benchmark("gpu_clocks")


# Lines as an H200 printed them (2026-11-27), and what nvidia-smi prints where a field is absent.
CAPPED = "2026/11/27 00:56:14.662, 1470 MHz, 690.11 W, 0x0000000000000004"
FREE = "2026/11/27 00:56:16.068, 1965 MHz, 476.48 W, 0x0000000000000000"


def test_parse_line_reads_an_h200_sample(clocks):
    when, mhz, watts, reasons = clocks.parse_line(CAPPED + "\n")
    assert when == dt.datetime(2026, 11, 27, 0, 56, 14, 662000)
    assert (mhz, watts, reasons) == (1470.0, 690.11, clocks.POWER_CAP)
    assert clocks.parse_line("2026/11/27 00:56:14.662, [N/A], 690.11 W, 0x4") is None
    assert clocks.parse_line('Field "clocks_event_reasons.active" is not a valid field') is None


def test_summarize_counts_capped_and_slowed_samples(clocks):
    thermal = "2026/11/27 00:56:17.000, 1300 MHz, 650.00 W, 0x0000000000000024"
    samples = [clocks.parse_line(x) for x in (CAPPED, FREE, thermal, CAPPED)]
    got = clocks.summarize(samples)
    assert got["status"] == "ok" and got["samples"] == 4
    assert got["sm_mhz_min_p50_max"] == [1300.0, 1470.0, 1965.0]
    assert got["power_w_p50"] == 690.11
    assert got["power_capped"] == 0.75 and got["slowed"] == 0.25
    assert clocks.summarize([])["status"] == "skipped"


def _fake_smi(directory, body: str) -> None:
    path = directory / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _sampling_smi(directory, monkeypatch, sample: str) -> None:
    """A fake nvidia-smi on PATH that prints ``<now>, sample`` every 20 ms under ``-lms``, as
    the real one does, and reads the instant power field."""
    _fake_smi(
        directory,
        f'case "$*" in *-lms*) while true; do echo "$(date +"%Y/%m/%d %H:%M:%S.%3N"), {sample}"; '
        'sleep 0.02; done ;; *power.draw.instant*) echo "1.00 W" ;; esac\n',
    )
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")


def test_sampler_keeps_only_the_window(clocks, tmp_path, monkeypatch):
    _sampling_smi(tmp_path, monkeypatch, "1500 MHz, 699.50 W, 0x4")
    with clocks.ClockSampler(interval_ms=20) as sampler:
        time.sleep(0.3)
        start = sampler.mark()
        time.sleep(0.3)
        end = sampler.mark()
        time.sleep(0.2)
    got = sampler.summary(start, end)
    assert got["status"] == "ok", got
    assert got["sm_mhz_min_p50_max"] == [1500.0] * 3 and got["power_capped"] == 1.0
    assert 3 <= got["samples"] < len(sampler.samples)
    assert got["power_field"] == "power.draw.instant"
    assert (
        sampler.summary(end + dt.timedelta(hours=1), end + dt.timedelta(hours=2))["status"]
        == "skipped"
    )


def test_sampler_says_why_without_samples(clocks, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with clocks.ClockSampler() as sampler:
        pass
    assert sampler.summary(sampler.mark(), sampler.mark()) == {
        "status": "skipped",
        "reason": "nvidia-smi is not on PATH",
    }
    _fake_smi(tmp_path, 'echo "NVIDIA-SMI has failed because it could not talk to the driver"\n')
    with clocks.ClockSampler() as sampler:
        time.sleep(0.2)
    got = sampler.summary(dt.datetime.min, dt.datetime.max)
    assert got["status"] == "skipped" and "could not talk to the driver" in got["reason"]
    assert got["power_field"] == "power.draw"  # what an nvidia-smi without the instant one reads


def test_an_nvidia_smi_that_ignores_sigterm_is_killed(clocks, tmp_path, monkeypatch):
    _fake_smi(
        tmp_path,
        "case \"$*\" in *-lms*) trap '' TERM; while true; do sleep 0.05; done ;; "
        '*) echo "1.00 W" ;; esac\n',
    )
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(clocks.ClockSampler, "stop_timeout_s", 0.2)
    start = time.monotonic()
    with clocks.ClockSampler() as sampler:
        time.sleep(0.1)
    assert time.monotonic() - start < 5
    assert sampler._proc.returncode is not None  # it ended: killed


def test_sampled_loop_times_calls_and_sums_their_samples(clocks, tmp_path, monkeypatch):
    _sampling_smi(tmp_path, monkeypatch, "1600 MHz, 650.00 W, 0x0")
    steps = []
    wall, got = clocks.sampled_loop(lambda: steps.append(time.sleep(0.05)), 0.5, calls_per_step=5)
    assert wall >= 0.05 / 5  # a step of five calls takes at least its sleep
    assert 0.5 <= wall * 5 * len(steps) < 1.0  # the loop ran its 0.5 s, and about no longer
    assert got["status"] == "ok" and got["power_w_p50"] == 650.0 and got["samples"] >= 10
