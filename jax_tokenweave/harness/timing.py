"""Wall-clock timing of jitted JAX calls, shared by the main job and the benchmarks.

Every function is timed the same way: a number of untimed warm-up calls, then ``iters`` timed
calls, each ``fn()`` followed by ``jax.block_until_ready`` on its result (or ``ahead`` calls
dispatched back to back, then waited for). With several
functions, the timed calls are interleaved round-robin so that clock or thermal drift during
the run affects them all alike.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Stats:
    """Latency samples of one function, in milliseconds, in the order they were taken."""

    samples_ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples_ms:
            raise ValueError("Stats needs at least one sample")

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100, linear interpolation) in ms."""
        return float(np.percentile(np.asarray(self.samples_ms), q))

    @property
    def median_ms(self) -> float:
        return self.percentile(50)

    @property
    def p10_ms(self) -> float:
        return self.percentile(10)

    @property
    def p90_ms(self) -> float:
        return self.percentile(90)

    @property
    def mean_ms(self) -> float:
        return float(np.mean(self.samples_ms))

    @property
    def min_ms(self) -> float:
        return float(min(self.samples_ms))

    def summary(self, *, samples: bool = True) -> dict[str, Any]:
        """A JSON-ready dict: median, p10, p90, mean, min, iters and (optionally) the samples."""
        out: dict[str, Any] = {
            "median_ms": self.median_ms,
            "p10_ms": self.p10_ms,
            "p90_ms": self.p90_ms,
            "mean_ms": self.mean_ms,
            "min_ms": self.min_ms,
            "iters": len(self.samples_ms),
        }
        if samples:
            out["samples_ms"] = list(self.samples_ms)
        return out


def time_once(fn: Callable[[], Any], ahead: int = 1) -> float:
    """Run ``fn()`` ``ahead`` times back to back, wait for every result on the device, return
    the elapsed ms per run. ``ahead`` > 1 dispatches each run while the ones before it execute,
    as a server does, so the host's dispatch hides behind the devices' work where it is shorter.
    """
    import jax

    start = time.perf_counter()
    jax.block_until_ready([fn() for _ in range(ahead)])
    return (time.perf_counter() - start) * 1e3 / ahead


def benchmark(
    fns: Mapping[str, Callable[[], Any]],
    *,
    warmup: int = 3,
    iters: int = 20,
    interleave: bool = True,
    on_step: Callable[[], None] | None = None,
    ahead: int = 1,
) -> dict[str, Stats]:
    """Time each zero-argument function of ``fns``; returns ``{name: Stats}``.

    ``fns``: name -> function returning JAX arrays (jitted; the warm-up calls may compile).
    ``warmup`` (>= 0) untimed, then ``iters`` (>= 1) timed samples per function, each of
    ``ahead`` runs dispatched back to back (:func:`time_once`); ``interleave``: round-robin
    (``a b c a b c``) rather than one after the other. ``on_step``: called after every sample,
    warm-up or timed, ``len(fns) * (warmup + iters)`` in all (e.g. a progress bar).
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if ahead < 1:
        raise ValueError(f"ahead must be >= 1, got {ahead}")
    if not fns:
        raise ValueError("nothing to time: fns is empty")
    step = on_step or (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            time_once(fn, ahead)
            step()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    if interleave:
        for _ in range(iters):
            for name, fn in fns.items():
                samples[name].append(time_once(fn, ahead))
                step()
    else:
        for name, fn in fns.items():
            for _ in range(iters):
                samples[name].append(time_once(fn, ahead))
                step()
    return {name: Stats(tuple(values)) for name, values in samples.items()}


def rel_error(actual: Any, reference: Any) -> float:
    """``||actual - reference|| / ||reference||`` (Frobenius, float64); inf where not finite."""
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(reference, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("inf")
    denom = float(np.linalg.norm(b))
    diff = float(np.linalg.norm(a - b))
    return diff / denom if denom else diff
