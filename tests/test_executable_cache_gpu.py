"""The executable cache with the fused kernel on a GPU: an engine that weaves at TP 1 calls the
fused one-rank kernel for every add + RMSNorm, and those calls name their communicator by a
per-process id. A restart registers the same communicator under the same id, so it loads every
step program from disk (no tracing, no compiling) and makes the same tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpu_devices
from jax.sharding import Mesh
from testutil import engine_in_new_process

from jax_tokenweave.kernel import _ffi

pytestmark = pytest.mark.gpu


@pytest.mark.slow
def test_a_restart_loads_the_fused_kernel_programs_and_makes_the_same_tokens(tmp_path):
    if not gpu_devices():
        pytest.skip("needs a GPU")
    mesh = Mesh(np.array(gpu_devices()[:1]), ("tp",))
    if (why := _ffi.unavailable_reason(mesh, "tp", jnp.float32, (16, 64))) is not None:
        pytest.skip(why)
    weave = dict(schedule="weave", collective="ffi")  # "ffi": fail where the kernel cannot run
    first = engine_in_new_process(tmp_path, "gpu", 0, **weave)
    second = engine_in_new_process(tmp_path, "gpu", 0, **weave)
    n = first["compiled"]
    assert first["loaded"] == 0 and n >= 4 and first["compilations"] >= n
    assert (second["loaded"], second["compiled"], second["compilations"]) == (n, 0, 0)
    assert second["tokens"] == first["tokens"]
