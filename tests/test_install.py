"""The install's switch: ``JAX_TOKENWEAVE_BUILD_CUDA=0`` (or ``-DJAX_TOKENWEAVE_BUILD_CUDA=OFF``)
configures the project without the CUDA extension, also where ``nvcc`` is found (a CPU-only host
with the CUDA toolkit), so ``pip install -e .`` does not spend minutes compiling kernels."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def configure(tmp_path: Path, switch: str | None, *args: str) -> str:
    """CMake's configure output, the environment's switch set to ``switch`` (None: unset)."""
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("needs cmake and a C++ compiler")
    env = {k: v for k, v in os.environ.items() if k != "JAX_TOKENWEAVE_BUILD_CUDA"}
    if switch is not None:
        env["JAX_TOKENWEAVE_BUILD_CUDA"] = switch
    out = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


@pytest.mark.parametrize("value", ["0", "OFF", "false"])
def test_the_environment_switch_skips_the_cuda_build(tmp_path, value):
    text = configure(tmp_path, value)
    assert f"JAX_TOKENWEAVE_BUILD_CUDA={value}: not building the CUDA extension" in text
    assert "building the CUDA FFI extension" not in text and "CMAKE_CUDA" not in text


def test_the_cmake_option_skips_the_cuda_build(tmp_path):
    text = configure(tmp_path, None, "-DJAX_TOKENWEAVE_BUILD_CUDA=OFF")
    assert "JAX_TOKENWEAVE_BUILD_CUDA=OFF: not building the CUDA extension" in text
