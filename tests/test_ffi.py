"""CPU tests of the fused kernel's host side: the extension's import and limits, communicator
settings and availability reasons, the size policy, the one-shot wire encoding, fallback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_tokenweave.kernel import _extension, _ffi, comm, ops
from jax_tokenweave.kernel import policy as kernel_policy
from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.kernel.comm import CommSettings, Communicator
from jax_tokenweave.kernel.policy import KernelPolicy, PolicyRow
from jax_tokenweave.weave import tuning

needs_ext = pytest.mark.skipif(
    _extension.import_error() is not None,
    reason=f"extension not built: {_extension.import_error()}",
)


@needs_ext
def test_extension_imports_and_exposes_handlers():
    ext = _extension.get()
    assert set(ext.handlers()) == set(_ffi.TARGETS)
    lim = _extension.limits()
    assert lim["max_ranks"] == 8 and lim["min_ctas"] >= 1 and lim["max_ctas"] >= 16
    assert _ffi.register_targets() and _ffi.register_targets()  # idempotent, on CPU-only jax
    assert (lim["min_ctas"], lim["max_ctas"]) == (tuning.MIN_CTAS, tuning.MAX_CTAS)
    # the variant ids come from the extension's enum: the Python names are exactly its variants
    assert set(lim["algos"]) == set(kernel_policy.ALGOS)
    assert len(set(lim["algos"].values())) == len(lim["algos"])


@needs_ext
def test_extension_exports_only_its_init_function():
    """Exported libstdc++ instantiations broke `ostream << double` in modules loaded after this
    one (a segfault in ml_dtypes' str(), seen on the GPU image)."""
    tool = shutil.which("nm")
    if tool is None:
        pytest.skip("nm not found")
    out = subprocess.run(
        [tool, "-D", "--defined-only", _extension.get().__file__],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert [line.split()[-1] for line in out.splitlines()] == ["PyInit__tokenweave_ffi"]
    code = (
        "import jax_tokenweave.kernel._tokenweave_ffi, ml_dtypes, numpy as np; "
        "print(ml_dtypes.bfloat16(1.5), np.float64(2.5))"
    )  # the extension loaded first
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert ran.returncode == 0 and ran.stdout.split() == ["1.5", "2.5"], ran


@needs_ext
@pytest.mark.parametrize("n", [2, 4, 8])
def test_needed_bytes_per_algo(n):
    ext = _extension.get()
    tokens, hidden = 37, 1024
    q = ceil_div(tokens, n)
    # one-shot receive buffer: every peer's T partial rows and q residual rows
    assert ext.needed_bytes("one_shot", n, tokens, hidden, 2) == (n - 1) * (tokens + q) * hidden * 2
    # two-shot: reduce-scatter + all-gather staging of q rows per peer
    assert ext.needed_bytes("two_shot", n, tokens, hidden, 4) == 2 * (n - 1) * q * hidden * 4
    assert ext.needed_bytes("direct", n, 10**6, hidden, 2) == 16  # a mailbox, any size
    # a replicated residual: partial rows only
    got = ext.needed_bytes("one_shot", n, tokens, hidden, 2, residual_replicated=True)
    assert got == (n - 1) * tokens * hidden * 2
    with pytest.raises(ValueError, match="unknown algo"):
        ext.needed_bytes("three_shot", n, tokens, hidden, 2)


@needs_ext
def test_residual_replicated_fits_only_the_decode_one_shot_kernel():
    """One rank, or one-shot with a CTA per row and rows of at most 16 KiB, no multimem."""
    fits = _extension.get().residual_replicated_fits
    assert fits(1, 300, 8192, "bfloat16", "two_shot", False, 8)  # one rank: nothing exchanged
    assert fits(2, 16, 8192, "bfloat16", "one_shot", False, 16)
    assert fits(8, 1, 4096, "float32", "one_shot", False, 1)
    assert not fits(2, 17, 8192, "bfloat16", "one_shot", False, 16)  # T > CTAs
    assert not fits(2, 16, 8192, "float32", "one_shot", False, 16)  # 32 KiB rows
    assert not fits(2, 16, 8192, "bfloat16", "two_shot", False, 16)
    assert not fits(2, 16, 8192, "bfloat16", "one_shot", True, 16)  # multimem


def test_settings_from_env_and_validation(monkeypatch):
    monkeypatch.setenv("JAX_TOKENWEAVE_SLOTS", "3")
    monkeypatch.setenv("JAX_TOKENWEAVE_TIMEOUT_S", "2.5")
    monkeypatch.setenv("JAX_TOKENWEAVE_ALGO", "direct")
    s = CommSettings.from_env(num_slots=6)  # an explicit argument wins over the environment
    assert (s.num_slots, s.timeout_s, s.algo) == (6, 2.5, "direct")
    assert s.area_bytes % 256 == 0 and s.area_bytes * 2 * 6 <= s.workspace_mib * 2**20
    for bad in (dict(num_slots=0), dict(timeout_s=0), dict(algo="push"), dict(workspace_mib=-1)):
        with pytest.raises(ValueError):
            CommSettings(**bad)
    assert s.launch_gate  # on unless turned off
    monkeypatch.setenv("JAX_TOKENWEAVE_LAUNCH_GATE", "0")
    assert not CommSettings.from_env().launch_gate
    assert CommSettings.from_env(launch_gate=True).launch_gate
    monkeypatch.setenv("JAX_TOKENWEAVE_ALGO", "three_shot")
    with pytest.raises(ValueError, match="algo"):
        CommSettings.from_env()


def test_policy_choice_and_validation(monkeypatch):
    policy = KernelPolicy(
        {
            2: (PolicyRow(1000, "one_shot", 8), PolicyRow(None, "direct", 16)),
            8: (PolicyRow(None, "two_shot", 4),),
        }
    )
    assert policy.choose(2, 1000) == PolicyRow(1000, "one_shot", 8)
    assert policy.choose(2, 1001).algo == "direct"
    assert policy.choose(1, 10).algo == "one_shot"  # next larger size present
    assert policy.choose(4, 10).algo == "two_shot" and policy.choose(16, 10).algo == "two_shot"
    assert KernelPolicy.from_json(json.loads(json.dumps(policy.to_json()))) == policy
    with pytest.raises(ValueError, match="max_bytes=None"):
        KernelPolicy({2: (PolicyRow(10, "direct", 8),)})
    with pytest.raises(ValueError, match="increasing"):
        KernelPolicy(
            {
                2: (
                    PolicyRow(10, "direct", 8),
                    PolicyRow(5, "direct", 8),
                    PolicyRow(None, "direct", 8),
                )
            }
        )
    with pytest.raises(ValueError, match="not a kernel policy"):
        KernelPolicy.from_json({"rows": []})
    shipped = kernel_policy.load()
    for n in (2, 4, 8):  # the shipped table covers every group size the kernel supports
        assert shipped.rows(n) is shipped.by_ranks[n]


def test_choose_auto_env_and_allocator(monkeypatch):
    policy = KernelPolicy({2: (PolicyRow(64 * 1024, "one_shot", 8), PolicyRow(None, "direct", 16))})
    s = CommSettings()
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    assert comm.choose(2, jnp.bfloat16, (1, 8192), s, policy=policy) == ("one_shot", 8)
    assert comm.choose(2, jnp.bfloat16, (128, 8192), s, policy=policy) == ("direct", 16)
    assert comm.choose(2, jnp.bfloat16, (128, 8192), s, policy=policy, num_ctas=4)[1] == 4
    assert (
        comm.choose(2, jnp.bfloat16, (1, 8192), CommSettings(algo="two_shot"), policy=policy)[0]
        == "two_shot"
    )
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")  # direct ruled out
    assert comm.choose(2, jnp.bfloat16, (128, 8192), s, policy=policy)[0] == "two_shot"
    with pytest.raises(RuntimeError, match="cuda_async"):
        comm.choose(2, jnp.bfloat16, (128, 8192), s, algo="direct", policy=policy)
    with pytest.raises(ValueError):
        comm.choose(2, jnp.bfloat16, (1, 8192), s, algo="three_shot")


def test_choose_across_processes_and_ctas_of_another_variant(monkeypatch):
    policy = KernelPolicy({2: (PolicyRow(1 << 20, "one_shot", 64), PolicyRow(None, "direct", 16))})
    s = CommSettings()
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    # direct reads XLA's buffers by address: never across processes
    assert (
        comm.choose(2, jnp.bfloat16, (128, 8192), s, policy=policy, cross_process=True)[0]
        == "two_shot"
    )
    with pytest.raises(RuntimeError, match="spans processes"):
        comm.choose(
            2, jnp.bfloat16, (128, 8192), s, algo="direct", policy=policy, cross_process=True
        )
    # an explicit barrier variant where the table names one-shot with 64 CTAs gets at most
    # the barrier kernels' limit (from the extension)
    monkeypatch.setattr(comm._extension, "import_error", lambda: None)
    monkeypatch.setattr(comm._extension, "limits", lambda: {"max_ctas": 32})
    assert comm.choose(2, jnp.bfloat16, (4, 8192), s, algo="two_shot", policy=policy) == (
        "two_shot",
        32,
    )
    assert comm.choose(2, jnp.bfloat16, (4, 8192), s, policy=policy) == ("one_shot", 64)


@needs_ext
def test_shape_reasons(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    s = CommSettings()
    reason = comm.shape_reason
    assert reason(2, jnp.bfloat16, (128, 8192), s) is None
    assert "not supported" in reason(2, jnp.int32, (128, 8192), s)
    assert "multiple of 8" in reason(2, jnp.bfloat16, (128, 8190), s)
    assert "num_ctas=0" in reason(2, jnp.bfloat16, (128, 64), s, num_ctas=0)
    assert "num_ctas=65" in reason(2, jnp.bfloat16, (128, 64), s, num_ctas=65, algo="direct")
    assert reason(2, jnp.bfloat16, (128, 64), s, num_ctas=64, algo="direct") is None
    assert reason(2, jnp.bfloat16, (128, 64), s, num_ctas=64, algo="one_shot") is None
    assert "num_ctas=129" in reason(2, jnp.bfloat16, (128, 64), s, num_ctas=129)
    assert "slot 9" in reason(2, jnp.bfloat16, (128, 64), s, slot=9)
    assert "at most 8" in reason(16, jnp.bfloat16, (128, 64), s)
    small = CommSettings(workspace_mib=64, oneshot_mib=1)
    assert reason(4, jnp.bfloat16, (16384, 8192), small) is None  # direct: a mailbox only
    why = reason(4, jnp.bfloat16, (16384, 8192), small, algo="two_shot")
    assert "workspace_mib" in why and "needs" in why
    why = reason(2, jnp.bfloat16, (256, 8192), small, algo="one_shot")
    assert "oneshot_mib" in why
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")
    assert "cuda_async" in reason(2, jnp.bfloat16, (128, 8192), s, algo="direct")


@needs_ext
def test_a_replicated_residual_needs_no_buffer_for_residual_rows():
    """[64, 8192] bf16 at N = 2, one-shot: 1.5 MiB of the buffer token-sharded (64 partial rows
    and 32 residual rows), 1 MiB with the residual replicated (no residual rows travel)."""
    s = CommSettings(workspace_mib=64, oneshot_mib=1.25)
    reason = comm.shape_reason
    why = reason(2, jnp.bfloat16, (64, 8192), s, algo="one_shot")
    assert "oneshot_mib" in why and f"needs {3 << 19} bytes" in why
    assert reason(2, jnp.bfloat16, (64, 8192), s, algo="one_shot", residual_replicated=True) is None
    why = reason(2, jnp.bfloat16, (96, 8192), s, algo="one_shot", residual_replicated=True)
    assert f"needs {96 * 8192 * 2} bytes" in why


def test_missing_extension_reason(monkeypatch, cpu_mesh):
    monkeypatch.setattr(_extension, "_module", None)
    monkeypatch.setattr(_extension, "_IMPORT_ERROR", "ImportError: no module named _tokenweave_ffi")
    why = Communicator(cpu_mesh(2), "tp").unavailable_reason(jnp.bfloat16, (16, 64))
    assert "extension is not available" in why and "no module named" in why
    with pytest.raises(RuntimeError, match="not available"):
        _extension.get()


@needs_ext
def test_reasons_on_cpu_devices(cpu_mesh):
    why = _ffi.unavailable_reason(cpu_mesh(4), "tp", jnp.bfloat16, (16, 64))
    assert why is not None and "not CUDA GPUs" in why
    assert "concrete mesh" in _ffi.unavailable_reason(None, "tp", jnp.bfloat16, (16, 64))
    assert "not an axis" in _ffi.unavailable_reason(cpu_mesh(2), "dp", jnp.bfloat16, (16, 64))
    with pytest.raises(RuntimeError, match="not CUDA GPUs"):
        Communicator(cpu_mesh(2), "tp").comm_id  # noqa: B018


def test_shared_communicator_follows_the_environment(monkeypatch, cpu_mesh):
    mesh = cpu_mesh(2)
    a = comm.get_communicator(mesh, "tp")
    assert comm.get_communicator(mesh, "tp") is a
    monkeypatch.setenv("JAX_TOKENWEAVE_SLOTS", "7")
    b = comm.get_communicator(mesh, "tp")
    assert b is not a and b.settings.num_slots == 7


def test_reset_drops_and_closes_the_shared_communicators(monkeypatch, cpu_mesh):
    # Start with none: earlier tests of the process (a GPU engine's auto comm) may have made
    # shared communicators with real workspaces.
    comm.reset_communicators()
    mesh = cpu_mesh(2)
    a = comm.get_communicator(mesh, "tp")
    released = []
    fake = type("Ext", (), {"release_comm": staticmethod(released.append)})
    monkeypatch.setattr(comm._extension, "get", lambda: fake)
    a._id = 41  # as if its workspace had been allocated
    assert comm.reset_communicators() >= 1
    assert released == [41] and a._id is None
    assert comm.get_communicator(mesh, "tp") is not a  # the next use builds a new one


def test_peer_buffer_reason(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    assert comm.peer_buffer_reason() is None
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    assert comm.peer_buffer_reason() is None
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")
    assert "cuda_async" in comm.peer_buffer_reason()


@pytest.mark.parametrize(("shape", "axis"), [((2, 4), "tp"), ((2, 4), "dp"), ((2, 2, 2), "tp")])
def test_device_groups(shape, axis):
    names = ("dp", "tp") if len(shape) == 2 else ("pp", "dp", "tp")
    devices = np.array(jax.devices("cpu")[:8]).reshape(shape)
    mesh = jax.sharding.Mesh(devices, names)
    groups = comm.device_groups(mesh, axis)
    size = mesh.shape[axis]
    assert all(len(g) == size for g in groups) and len(groups) == 8 // size
    assert sorted(d.id for g in groups for d in g) == list(range(8))  # a partition
    ax = names.index(axis)
    for g in groups:  # the members of a group differ only in the axis coordinate
        coords = [np.argwhere(devices == d)[0] for d in g]
        assert all(np.delete(c, ax).tolist() == np.delete(coords[0], ax).tolist() for c in coords)


@needs_ext
def test_multimem_refuses_when_nvls_disabled(monkeypatch):
    monkeypatch.setenv("JAX_TOKENWEAVE_MULTIMEM", "1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert "NCCL_NVLS_ENABLE=0" in comm.multimem_refusal(CommSettings.from_env())
    assert "NCCL_NVLS_ENABLE=0" in _extension.get().multimem_refusal()
    why = comm.shape_reason(2, jnp.bfloat16, (16, 64), CommSettings.from_env())
    assert "NCCL_NVLS_ENABLE=0" in why
    # C++ refuses before any CUDA or multicast call (works without a driver).
    with pytest.raises(RuntimeError, match="NCCL_NVLS_ENABLE=0"):
        _extension.get().register_comm([0, 1], 2, 1 << 20, 1 << 20, 4, 10.0, True)
    monkeypatch.delenv("JAX_TOKENWEAVE_MULTIMEM")
    assert "opt-in" in _extension.get().multimem_refusal()
    assert "opt-in" in comm.multimem_refusal(CommSettings.from_env())


def _random_words(rng, itemsize, count):
    """Random values of the dtype, with the encoding's corner cases planted."""
    if itemsize == 2:
        x = rng.standard_normal(count).astype(ml_dtypes.bfloat16).view(np.uint16)
        x[rng.integers(0, count, count // 8)] = 0x8000  # -0.0
        return x.tobytes()
    x = rng.standard_normal(count).astype(np.float32).view(np.uint32)
    x[rng.integers(0, count, count // 8)] = 0x80008000  # the sentinel's bits as a value
    x[rng.integers(0, count, count // 8)] = 0x80000000  # -0.0
    return x.tobytes()


@needs_ext
@pytest.mark.parametrize("itemsize", [2, 4])
def test_oneshot_encoding_never_sends_the_sentinel(rng, itemsize):
    ext = _extension.get()
    data = _random_words(rng, itemsize, 4096)
    encoded, pending = ext.oneshot_encode(data, itemsize)
    _, again = ext.oneshot_encode(encoded, itemsize)
    assert not any(again)  # no sent vector reads as "not written yet"
    assert any(pending)  # the planted values would have
    if itemsize == 2:  # the same numbers (-0 sent as +0)
        for t in (ml_dtypes.bfloat16, np.float16):
            a = np.frombuffer(data, t).astype(np.float64)
            b = np.frombuffer(encoded, t).astype(np.float64)
            np.testing.assert_array_equal(a, b)
    else:
        a = np.frombuffer(data, np.float32).astype(np.float64)
        b = np.frombuffer(encoded, np.float32).astype(np.float64)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-40)
    cleared = np.full(len(data) // 4, 0x80008000, np.uint32).tobytes()  # a cleared buffer
    assert all(ext.oneshot_encode(cleared, itemsize)[1])


def _run(mesh, impl, partial, residual, weight, **kw):
    def body(p, r, w):
        return ops.allreduce_rmsnorm(p, r, w, axis_name="tp", impl=impl, mesh=mesh, **kw)

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("tp"), P("tp"), P()),
        out_specs=(P("tp"), P("tp")),
        check_vma=False,
    )
    return jax.jit(f)(partial, residual, weight)


def _inputs(rng, n, tokens, hidden):
    rows = ops.rows_per_rank(tokens, n)
    partial = rng.standard_normal((n * tokens, hidden)).astype(np.float32)
    residual = rng.standard_normal((n * rows, hidden)).astype(np.float32)
    weight = rng.standard_normal(hidden).astype(np.float32)
    return partial, residual, weight


def test_ffi_raises_on_cpu(cpu_mesh, rng):
    with pytest.raises(RuntimeError, match="unavailable"):
        _run(cpu_mesh(2), "ffi", *_inputs(rng, 2, 5, 64))


def test_auto_falls_back_to_xla_rsag(cpu_mesh, rng):
    mesh = cpu_mesh(4)
    args = _inputs(rng, 4, 7, 64)
    got = _run(mesh, "auto", *args)
    want = _run(mesh, "xla_rsag", *args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@needs_ext
def test_kernel_binary_has_the_expected_code():
    default = "/usr/local/cuda/bin/cuobjdump"
    tool = shutil.which("cuobjdump") or (default if os.path.exists(default) else None)
    if tool is None:
        pytest.skip("cuobjdump not found")
    path = _extension.get().__file__
    ptx = subprocess.run(
        [tool, "--dump-ptx", path], capture_output=True, text=True, check=True
    ).stdout
    assert "multimem.ld_reduce" in ptx and "multimem.st" in ptx
    assert "st.release.sys" in ptx and "ld.acquire.sys" in ptx
    assert "ld.volatile.global.v4.u32" in ptx  # the one-shot poll
    assert "trap;" not in ptx  # a wait that expires returns; it never kills the context
    elf = subprocess.run(
        [tool, "--list-elf", path], capture_output=True, text=True, check=True
    ).stdout
    assert "sm_90a" in elf and "sm_80" in elf
