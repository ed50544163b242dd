"""The fused kernel with one process per GPU (jax.distributed), on GPUs: workspaces exchanged
as file descriptors, the result against float64 and bitwise across processes, and a peer that
stalls or dies making the others fail within the bound. With one GPU, both processes share
it (CUDA time-slices their kernels: slow, but the protocol and the mappings are the real ones).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
WORKER = Path(__file__).with_name("mp_worker.py")


def _gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    tmp_path: Path, scenario: str, nproc: int = 2, timeout_s: float = 4.0, algo: str = "one_shot"
) -> list[dict]:
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    gpus = _gpus()
    env = dict(
        os.environ,
        JAX_TOKENWEAVE_TIMEOUT_S=str(timeout_s),
        MP_ALGO=algo,
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
        JAX_PLATFORMS="cuda",
    )
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(r),
                str(nproc),
                coordinator,
                str(r % gpus),
                scenario,
                str(tmp_path / f"rank{r}.json"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(nproc)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    results = []
    for r, p in enumerate(procs):
        path = tmp_path / f"rank{r}.json"
        if scenario != "correct" and r == nproc - 1:
            continue  # the peer that stalls or dies writes nothing
        assert p.returncode == 0 and path.exists(), f"rank {r} failed:\n{logs[r][-4000:]}"
        results.append(json.loads(path.read_text()))
    return results


def test_fused_kernel_across_processes_matches_float64(tmp_path):
    res = _launch(tmp_path, "correct")
    assert all(r["cross_process"] for r in res)
    for key in [k for k in res[0] if "/" in k]:
        assert all(r[key]["rel_err"] < 8e-3 for r in res), key
        assert all(r[key]["rel_err_residual"] < 8e-3 for r in res), key
        assert len({r[key]["normed_sum"] for r in res}) == 1, key  # the same rows everywhere


@pytest.mark.parametrize("algo", ["one_shot", "ce"])
@pytest.mark.parametrize("scenario", ["stall", "kill"])
def test_a_missing_peer_process_fails_the_others_in_bounded_time(tmp_path, scenario, algo):
    """``ce``: the survivor's one-warp wait for the peer's flag gives up past the bound and
    reports, as the SM variants' waits do."""
    (survivor,) = _launch(tmp_path, scenario, timeout_s=4.0, algo=algo)
    assert survivor["error"] is not None and "rank 1" in survivor["error"]
    assert "never started this call" in survivor["error"]
    if algo == "ce":
        assert "copy-engine reduce-scatter" in survivor["error"]
    assert survivor["nan_outputs"]
    assert survivor["seconds"] < 4.0 + 20.0
