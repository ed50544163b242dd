"""``jax_tokenweave.kernel._util``: the helpers every module may import."""

from __future__ import annotations

import numpy as np
import pytest

from jax_tokenweave.kernel._util import ceil_div


@pytest.mark.parametrize("b", [1, 2, 3, 7, 256])
def test_ceil_div_matches_math_ceil(b):
    for a in range(0, 600):
        assert ceil_div(a, b) == -(-a // b) == (a + b - 1) // b


def test_ceil_div_is_elementwise_on_arrays():
    a = np.array([0, 1, 15, 16, 17, 300], np.int64)
    out = ceil_div(a, 16)
    assert out.dtype == a.dtype
    np.testing.assert_array_equal(out, [0, 1, 1, 1, 2, 19])
