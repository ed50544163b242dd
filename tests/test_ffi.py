"""CPU tests of the CUDA extension's Python side: import, registration, gating, fallback."""

from __future__ import annotations

import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_tokenweave import _ffi, ops

needs_ext = pytest.mark.skipif(_ffi.import_error() is not None,
                               reason=f"extension not built: {_ffi.import_error()}")


@needs_ext
def test_extension_imports_and_exposes_handlers():
    ext = _ffi._ext
    assert set(ext.handlers()) == set(_ffi.TARGETS)
    assert ext.MAX_CTAS == _ffi.MAX_CTAS and ext.MIN_CTAS == _ffi.MIN_CTAS
    assert ext.MAX_RANKS == _ffi.MAX_RANKS and ext.MAX_HIDDEN == _ffi.MAX_HIDDEN
    assert ext.area_bytes(_ffi.workspace_bytes(), _ffi.num_slots()) == _ffi.area_bytes()
    assert ext.two_shot_bytes(4, 3, 64, 2) == _ffi.needed_bytes(4, jnp.bfloat16, (10, 64), 1)
    assert ext.one_shot_bytes(4, 10, 3, 64, 2) == _ffi.needed_bytes(4, jnp.bfloat16, (10, 64), 2)


@needs_ext
def test_targets_register_on_cpu_only_jax():
    assert _ffi.register_targets()
    assert _ffi.register_targets()  # idempotent


def test_missing_extension_reason(monkeypatch, cpu_mesh):
    monkeypatch.setattr(_ffi, "_ext", None)
    monkeypatch.setattr(_ffi, "_IMPORT_ERROR", "ImportError: no module named _tokenweave_ffi")
    why = _ffi.unavailable_reason(cpu_mesh(2), "tp", jnp.bfloat16, (16, 64))
    assert "extension is not available" in why and "no module named" in why


@needs_ext
def test_reason_on_cpu_devices(cpu_mesh):
    why = _ffi.unavailable_reason(cpu_mesh(4), "tp", jnp.bfloat16, (16, 64))
    assert why is not None and "not CUDA GPUs" in why
    assert "concrete mesh" in _ffi.unavailable_reason(None, "tp", jnp.bfloat16, (16, 64))
    assert "not an axis" in _ffi.unavailable_reason(cpu_mesh(2), "dp", jnp.bfloat16, (16, 64))


def test_shape_reasons(monkeypatch):
    assert _ffi.shape_reason(2, jnp.bfloat16, (128, 8192)) is None
    assert "not supported" in _ffi.shape_reason(2, jnp.int32, (128, 8192))
    assert "multiple of 8" in _ffi.shape_reason(2, jnp.bfloat16, (128, 8190))
    assert "num_ctas=1" in _ffi.shape_reason(2, jnp.bfloat16, (128, 64), num_ctas=1)
    assert "num_ctas=33" in _ffi.shape_reason(2, jnp.bfloat16, (128, 64), num_ctas=33)
    assert "slot 9" in _ffi.shape_reason(2, jnp.bfloat16, (128, 64), slot=9)
    assert "at most 8" in _ffi.shape_reason(16, jnp.bfloat16, (128, 64))
    monkeypatch.setenv("JAX_TOKENWEAVE_WORKSPACE_MB", "64")
    monkeypatch.delenv("JAX_TOKENWEAVE_ALGO", raising=False)
    assert _ffi.shape_reason(4, jnp.bfloat16, (16384, 8192)) is None  # direct: no staging
    monkeypatch.setenv("JAX_TOKENWEAVE_ALGO", "two_shot")
    why = _ffi.shape_reason(4, jnp.bfloat16, (16384, 8192))
    assert "JAX_TOKENWEAVE_WORKSPACE_MB" in why and "needs" in why


def test_algo_resolution(monkeypatch):
    monkeypatch.setenv("JAX_TOKENWEAVE_ONESHOT_BYTES", str(64 * 1024))
    assert _ffi.resolve_algo("auto", 2, jnp.bfloat16, (1, 8192)) == 2
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    monkeypatch.delenv("JAX_TOKENWEAVE_ALGO", raising=False)
    assert _ffi.resolve_algo("auto", 2, jnp.bfloat16, (128, 8192)) == 3
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")  # direct ruled out
    assert _ffi.resolve_algo("auto", 2, jnp.bfloat16, (128, 8192)) == 1
    with pytest.raises(RuntimeError, match="cuda_async"):
        _ffi.resolve_algo("direct", 2, jnp.bfloat16, (128, 8192))
    monkeypatch.setenv("JAX_TOKENWEAVE_ALGO", "direct")
    with pytest.raises(RuntimeError, match="cuda_async"):
        _ffi.resolve_algo("auto", 2, jnp.bfloat16, (128, 8192))
    assert "cuda_async" in _ffi.shape_reason(2, jnp.bfloat16, (128, 8192))  # auto falls back
    monkeypatch.setenv("JAX_TOKENWEAVE_ALGO", "one_shot")
    assert _ffi.resolve_algo("auto", 2, jnp.bfloat16, (128, 8192)) == 2
    assert _ffi.resolve_algo("two_shot", 2, jnp.bfloat16, (1, 8192)) == 1
    with pytest.raises(ValueError):
        _ffi.resolve_algo("three_shot", 2, jnp.bfloat16, (1, 8192))


def test_peer_buffer_reason(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    assert _ffi.peer_buffer_reason() is None
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    assert _ffi.peer_buffer_reason() is None
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")
    assert "cuda_async" in _ffi.peer_buffer_reason()


def test_device_groups_of_2d_mesh():
    devices = np.array(jax.devices("cpu")[:8]).reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("dp", "tp"))
    groups = _ffi.device_groups(mesh, "tp")
    assert [[d.id for d in g] for g in groups] == [[d.id for d in row] for row in devices]
    groups = _ffi.device_groups(mesh, "dp")
    assert len(groups) == 4 and all(len(g) == 2 for g in groups)


@needs_ext
def test_multimem_refuses_when_nvls_disabled(monkeypatch, cpu_mesh):
    monkeypatch.setenv("JAX_TOKENWEAVE_MULTIMEM", "1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert "NCCL_NVLS_ENABLE=0" in _ffi.multimem_refusal()
    assert "NCCL_NVLS_ENABLE=0" in _ffi._ext.multimem_refusal()
    # C++ refuses before any CUDA or multicast call (works without a driver).
    with pytest.raises(RuntimeError, match="NCCL_NVLS_ENABLE=0"):
        _ffi._ext.register_comm([0, 1], 2, 1 << 26, 4, True)
    monkeypatch.delenv("JAX_TOKENWEAVE_MULTIMEM")
    assert "opt-in" in _ffi._ext.multimem_refusal()


def test_multimem_reason_in_unavailable_reason(monkeypatch, cpu_mesh):
    # Past the device checks the multimem refusal is reported; check its text directly.
    monkeypatch.setenv("JAX_TOKENWEAVE_MULTIMEM", "1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert "refuses" in _ffi.multimem_refusal()


def _run(mesh, impl, partial, residual, weight, **kw):
    n = mesh.shape["tp"]

    def body(p, r, w):
        return ops.allreduce_rmsnorm(p, r, w, axis_name="tp", impl=impl, mesh=mesh, **kw)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp"), P()),
                      out_specs=(P("tp"), P("tp")), check_vma=False)
    del n
    return jax.jit(f)(partial, residual, weight)


def _inputs(rng, n, tokens, hidden):
    rows = ops.rows_per_rank(tokens, n)
    partial = rng.standard_normal((n * tokens, hidden)).astype(np.float32)
    residual = rng.standard_normal((n * rows, hidden)).astype(np.float32)
    weight = rng.standard_normal(hidden).astype(np.float32)
    return partial, residual, weight


def test_ffi_raises_on_cpu(cpu_mesh, rng):
    mesh = cpu_mesh(2)
    with pytest.raises(RuntimeError, match="unavailable"):
        _run(mesh, "ffi", *_inputs(rng, 2, 5, 64))


def test_auto_falls_back_to_xla_rsag(cpu_mesh, rng):
    mesh = cpu_mesh(4)
    args = _inputs(rng, 4, 7, 64)
    got = _run(mesh, "auto", *args)
    want = _run(mesh, "xla_rsag", *args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@needs_ext
def test_multimem_instructions_in_the_binary():
    default = "/usr/local/cuda/bin/cuobjdump"
    tool = shutil.which("cuobjdump") or (default if os.path.exists(default) else None)
    if tool is None:
        pytest.skip("cuobjdump not found")
    out = subprocess.run([tool, "--dump-ptx", _ffi._ext.__file__], capture_output=True, text=True,
                         check=True).stdout
    assert "multimem.ld_reduce" in out and "multimem.st" in out
    assert "st.release.sys" in out and "ld.acquire.sys" in out
    sass = subprocess.run([tool, "--list-elf", _ffi._ext.__file__], capture_output=True,
                          text=True, check=True).stdout
    assert "sm_90a" in sass and "sm_80" in sass
