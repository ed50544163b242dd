"""``benchmarks/step_profile.py``'s interval arithmetic: busy time and the idle stretches."""

from __future__ import annotations

import pytest
from testutil import load_benchmark


@pytest.fixture(scope="module")
def step_profile():
    return load_benchmark("step_profile")


def test_busy_time_counts_overlapping_kernels_once(step_profile):
    assert step_profile.busy_us([(0, 5), (1, 3), (4, 7), (10, 12)]) == 9


def test_idle_gaps_by_size_with_their_neighbours(step_profile):
    spans = [(0, 5, "a"), (1, 3, "b"), (10, 12, "c"), (40, 41, "d"), (41.5, 42, "e"), (6, 9, "f")]
    gaps = step_profile.idle_gaps(spans, top=2)
    assert gaps["classes_us"] == {"lt_2us": 0.5 + 1 + 1, "2_20us": 0, "ge_20us": 28}
    assert gaps["longest"][0] == {"us": 28, "before": "c", "after": "d"}
    assert len(gaps["longest"]) == 2 and gaps["longest"][1]["us"] == 1
