"""Test set-up: 8 virtual CPU devices (set before jax is imported) and device fixtures."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

jax.config.update("jax_default_matmul_precision", "highest")
# Compile in memory only: engines default to a persistent cache under ~/.cache
# (tests/test_compilation_cache.py turns it on where it is tested).
jax.config.update("jax_enable_compilation_cache", False)


def gpu_devices() -> list[jax.Device]:
    """The CUDA devices of this process ([] where there are none)."""
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.fixture(scope="module")
def loopback():
    """The loopback module (every rank of a group on one GPU), where a GPU and the extension
    are present (else skip)."""
    from jax_tokenweave.kernel import _extension
    from jax_tokenweave.kernel import loopback as lb

    if not gpu_devices():
        pytest.skip("needs a CUDA GPU")
    if _extension.import_error() is not None:
        pytest.skip(f"extension not built: {_extension.import_error()}")
    return lb


@pytest.fixture
def cpu_mesh():
    """``cpu_mesh(tp)``: a 1-D ``Mesh`` named ``"tp"`` over the first ``tp`` CPU devices."""

    def make(tp: int, axis_name: str = "tp") -> Mesh:
        devices = jax.devices("cpu")
        if len(devices) < tp:
            pytest.skip(f"needs {tp} CPU devices, have {len(devices)}")
        return Mesh(np.array(devices[:tp]), (axis_name,))

    return make


@pytest.fixture
def gpu_mesh():
    """``gpu_mesh(tp)``: a 1-D ``Mesh`` named ``"tp"`` over ``tp`` GPUs; skips where too few."""

    def make(tp: int, axis_name: str = "tp") -> Mesh:
        devices = gpu_devices()
        if len(devices) < tp:
            pytest.skip(f"needs {tp} GPUs, have {len(devices)}")
        return Mesh(np.array(devices[:tp]), (axis_name,))

    return make


@pytest.fixture
def ffi_mesh2(gpu_mesh):
    """A 2-GPU ``"tp"`` mesh on which the fused CUDA kernel can run; skips, saying why, where
    it cannot (too few GPUs, extension not built, devices not peers, ...). Garbage is collected
    before and after the test, while no call is in flight: freeing a jitted function unloads
    its CUDA modules, which in one process can hold back a GPU's launch while a fused kernel
    spins for it (ffi/README.md, "One process, several GPUs")."""
    import gc

    import jax.numpy as jnp

    from jax_tokenweave.kernel import _ffi

    mesh = gpu_mesh(2)
    if _ffi.import_error() is not None:
        pytest.skip(f"extension not built: {_ffi.import_error()}")
    why = _ffi.unavailable_reason(mesh, "tp", jnp.bfloat16, (1024, 4096))
    if why is not None:
        pytest.skip(why)
    gc.collect()
    yield mesh
    gc.collect()
    from jax_tokenweave.kernel.comm import CommFailed, get_communicator, reset_communicators

    try:  # a test whose wait expired leaves the shared communicator failed: start over, so
        get_communicator(mesh, "tp").check()  # the next test's result is its own
    except CommFailed:
        reset_communicators()


DEFAULT_SEED = 0
"""The ``rng`` fixture's seed unless ``TEST_SEED`` names another (``TEST_SEED=random``: one
drawn from the OS)."""


def seed_from_env() -> int:
    """The seed of this run: ``TEST_SEED`` (an int, or ``random``) else :data:`DEFAULT_SEED`."""
    value = os.environ.get("TEST_SEED", "").strip()
    if not value:
        return DEFAULT_SEED
    if value.lower() == "random":
        return int(np.random.SeedSequence().entropy % (2**32))
    return int(value)


def pytest_report_header(config) -> str:
    seed = os.environ.get("TEST_SEED", "").strip() or DEFAULT_SEED
    return f"numpy seed (rng fixture): {seed} (TEST_SEED overrides it)"


@pytest.fixture
def rng() -> np.random.Generator:
    """Random inputs from a fixed seed (``TEST_SEED`` overrides it), printed so a failure can be
    replayed with ``TEST_SEED=<seed>``."""
    seed = seed_from_env()
    print(f"numpy seed: {seed}")
    return np.random.default_rng(seed)
