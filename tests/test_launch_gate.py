"""The launch gate's host logic (ffi/collective/launch_gate.h), run by the extension on host
threads with no GPU: a device's n-th call waits until every local device of the comm reached
its n-th."""

from __future__ import annotations

import pytest

from jax_tokenweave.kernel import _extension

pytestmark = pytest.mark.skipif(
    _extension.import_error() is not None,
    reason=f"extension not built: {_extension.import_error()}",
)


def trial(ordinals, arrivals, timeout_s=2.0):
    """Per arrival: (call, late ordinal or -1, the late one's calls, seconds waited)."""
    return _extension.get().launch_gate_trial(ordinals, arrivals, timeout_s)


def test_the_first_to_arrive_waits_for_the_last():
    first, last = trial([0, 1], [(0, 0.0), (1, 0.3)])
    assert first[:3] == (1, -1, 0) and 0.2 < first[3] < 1.5
    assert last[:3] == (1, -1, 0) and last[3] < 0.1


def test_calls_pair_by_count_across_devices():
    out = trial([0, 1, 2], [(0, 0.0), (1, 0.0), (2, 0.2), (0, 0.25), (1, 0.25), (2, 0.4)])
    assert [o[0] for o in out] == [1, 1, 1, 2, 2, 2]
    assert all(o[1] == -1 for o in out)
    assert out[0][3] > 0.1 and out[3][3] > 0.1  # each round waited for device 2


def test_a_device_that_never_arrives_is_named_after_the_bound():
    (alone,) = trial([3, 5], [(3, 0.0)], timeout_s=0.3)
    assert alone[:3] == (1, 5, 0) and 0.25 < alone[3] < 2.0
    late = trial([0, 1], [(0, 0.0), (1, 0.0), (0, 0.1)], timeout_s=0.3)[2]
    assert late[:3] == (2, 1, 1)  # device 1 had reached call 1, not 2


def test_the_gate_is_open_for_one_device_and_for_others():
    assert [o[1] for o in trial([0], [(0, 0.0), (0, 0.0)], timeout_s=5.0)] == [-1, -1]
    assert trial([], [(0, 0.0)], timeout_s=5.0)[0][1] == -1
    (other,) = trial([0, 1], [(7, 0.0)], timeout_s=5.0)  # not a device of the comm
    assert other[1] == -1 and other[3] < 1.0
