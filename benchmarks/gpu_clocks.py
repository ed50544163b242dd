"""The SM clock, power draw and clock-limit reasons of a GPU while a benchmark runs.

An H200 held to its 700 W power limit lowers its SM clock: the engine's batch-256 decode step
(attention streaming K/V at ~4.1 TB/s, then GEMMs near their compute peak) ran at 1450-1600 MHz
where the same GEMMs alone ran at 1750-1850 (max 1980), every sample flagged "SW power cap"
(``benchmarks/results/2026-11-27-h200x1``). A step time then depends on the GPU's power
headroom, which a roofline of bytes does not see; the benchmarks record it beside their times.

:class:`ClockSampler` runs ``nvidia-smi --query-gpu ... -lms`` in the background for the length
of a ``with`` block; :meth:`ClockSampler.summary` sums up the samples between two
:meth:`ClockSampler.mark` calls; :func:`sampled_loop` repeats a call under one. Without
``nvidia-smi`` the summary says so.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

FIELDS = "timestamp,clocks.sm,{power},clocks_event_reasons.active"
# ``power.draw`` is a one-second average on recent drivers (a window of a few decode steps read
# 130-260 W on an H200 while its clock was held by the 700 W cap); the instant reading where
# nvidia-smi has it.
POWER_FIELDS = ("power.draw.instant", "power.draw")
POWER_CAP = 0x4  # "SW power cap": the clock is lowered to hold the power limit
SLOWDOWNS = 0x8 | 0x20 | 0x40 | 0x80  # HW slowdown, SW / HW thermal, HW power brake
_STAMP = "%Y/%m/%d %H:%M:%S.%f"


def parse_line(line: str) -> tuple[dt.datetime, float, float, int] | None:
    """``(time, SM MHz, watts, reasons bit mask)`` of one CSV line, or None (a line that is not
    a sample: nvidia-smi's errors, ``[N/A]`` fields)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        return (
            dt.datetime.strptime(parts[0], _STAMP),
            float(parts[1].split()[0]),
            float(parts[2].split()[0]),
            int(parts[3], 16),
        )
    except (ValueError, IndexError):
        return None


def summarize(samples: list[tuple[dt.datetime, float, float, int]]) -> dict[str, Any]:
    """SM clock (min / median / max MHz), median power (W) and the share of samples whose
    clock was held down by the power cap or by a slowdown."""
    if not samples:
        return {"status": "skipped", "reason": "no samples in the window"}
    mhz = sorted(s[1] for s in samples)
    watts = sorted(s[2] for s in samples)
    n = len(samples)
    return {
        "status": "ok",
        "samples": n,
        "sm_mhz_min_p50_max": [mhz[0], mhz[n // 2], mhz[-1]],
        "power_w_p50": watts[n // 2],
        "power_capped": sum(1 for s in samples if s[3] & POWER_CAP) / n,
        "slowed": sum(1 for s in samples if s[3] & SLOWDOWNS) / n,
    }


def _visible_gpu() -> str:
    """nvidia-smi's index of the process's first visible GPU (``CUDA_VISIBLE_DEVICES``)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return first or "0"


def _power_field(smi: str, gpu: str) -> str:
    """The first of :data:`POWER_FIELDS` that this nvidia-smi reads as watts."""
    for field in POWER_FIELDS[:-1]:
        try:
            out = subprocess.run(
                [smi, f"--query-gpu={field}", "--format=csv,noheader", "-i", gpu],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.strip().endswith("W"):
            return field
    return POWER_FIELDS[-1]


class ClockSampler:
    """``with ClockSampler() as s: t0 = s.mark(); ...; s.summary(t0, s.mark())``."""

    stop_timeout_s = 5.0  # at the block's end, nvidia-smi is killed if it outlasts this

    def __init__(self, interval_ms: int = 50, gpu: str | None = None) -> None:
        self.interval_ms = interval_ms
        self.gpu = _visible_gpu() if gpu is None else gpu
        self.samples: list[tuple[dt.datetime, float, float, int]] = []
        self.reason = ""
        self.power_field = ""
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> ClockSampler:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            self.reason = "nvidia-smi is not on PATH"
            return self
        self.power_field = _power_field(smi, self.gpu)
        query = FIELDS.format(power=self.power_field)
        cmd = [smi, f"--query-gpu={query}", "--format=csv,noheader", f"-lms={self.interval_ms}"]
        self._proc = subprocess.Popen(
            [*cmd, "-i", self.gpu], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_line(line)
            if sample is not None:
                self.samples.append(sample)
            elif not self.samples and not self.reason:
                self.reason = f"nvidia-smi: {line.strip()[:200]}"

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:  # an nvidia-smi stuck in the driver
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)

    @staticmethod
    def mark() -> dt.datetime:
        """Now, on nvidia-smi's clock (local time)."""
        return dt.datetime.now()

    def summary(self, start: dt.datetime, end: dt.datetime) -> dict[str, Any]:
        """:func:`summarize` of the samples taken from ``start`` to ``end``."""
        if self._proc is None:
            return {"status": "skipped", "reason": self.reason}
        found = summarize([s for s in list(self.samples) if start <= s[0] <= end])
        found["power_field"] = self.power_field
        if found["status"] != "ok" and self.reason:
            found["reason"] = self.reason
        return found


def sampled_loop(
    step: Callable[[], object], seconds: float, calls_per_step: int = 1, interval_ms: int = 20
) -> tuple[float, dict[str, Any]]:
    """Repeats ``step`` (which runs ``calls_per_step`` calls and waits for them) for
    ``seconds`` under a :class:`ClockSampler`, from nvidia-smi's first sample on. Returns the
    wall seconds per call and the :meth:`ClockSampler.summary` of the loop."""
    with ClockSampler(interval_ms=interval_ms) as sampler:
        time.sleep(0.3)  # nvidia-smi's first sample
        start, t0, steps = sampler.mark(), time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            step()
            steps += 1
        wall = (time.perf_counter() - t0) / (steps * calls_per_step)
        return wall, sampler.summary(start, sampler.mark())
