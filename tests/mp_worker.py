"""One process of a one-process-per-GPU run (tests/test_multiprocess_gpu.py starts them).

  python tests/mp_worker.py RANK NPROC COORDINATOR DEVICE SCENARIO OUT_JSON

Every process calls ``jax.distributed.initialize`` with its own GPU (DEVICE; the same one for
every process is allowed, to test on one GPU), builds the 1-D "tp" mesh of all processes'
devices, and runs the fused kernel through ``shard_map``. Scenarios:
  ``correct``: each algo at a few sizes against float64, every process's rows bitwise equal
               (written to OUT_JSON for the parent to compare); ``replicated`` is one-shot with
               the residual replicated ([T, H] on every process);
  ``stall``:   after one good call the last rank stops calling; the others' next call must
               fail within the bound with an error naming it;
  ``kill``:    like ``stall`` but the last rank exits abruptly.
``stall`` and ``kill`` run the variant named by the environment's ``MP_ALGO`` (one_shot).
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_tokenweave.harness.benchmarking import global_array, local_data
from jax_tokenweave.kernel import _ffi
from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.kernel.comm import CommFailed, get_communicator
from jax_tokenweave.kernel.loopback import reference


def _run(mesh, partial, residual, weight, algo):
    n, tokens, hidden = partial.shape
    replicated = algo == "replicated"
    kernel = "one_shot" if replicated else algo
    fn = jax.jit(
        jax.shard_map(
            lambda p, r, w: _ffi.allreduce_rmsnorm(
                p, r, w, axis_name="tp", mesh=mesh, algo=kernel, residual_replicated=replicated
            ),
            mesh=mesh,
            in_specs=(P("tp"), P("tp"), P()),
            out_specs=(P("tp"), P("tp")),
            check_vma=False,
        )
    )
    normed, res_out = fn(
        global_array(mesh, partial.reshape(n * tokens, hidden), P("tp")),
        global_array(mesh, residual.reshape(-1, hidden), P("tp")),
        jax.numpy.asarray(weight),
    )
    return local_data(normed), local_data(res_out)  # one device per process: its rows


def main() -> int:
    rank, nproc, coordinator, device, scenario, out = sys.argv[1:7]
    rank, nproc = int(rank), int(nproc)
    jax.distributed.initialize(
        coordinator, num_processes=nproc, process_id=rank, local_device_ids=[int(device)]
    )
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    comm = get_communicator(mesh, "tp")
    result: dict = {"rank": rank, "cross_process": comm.cross_process}
    rng = np.random.default_rng(0)  # the same global inputs in every process
    import ml_dtypes

    cases = (
        [
            ("one_shot", 1, 8192),
            ("one_shot", 13, 4096),
            ("two_shot", 64, 4096),
            ("two_shot", 5, 2048),
            ("ce", 64, 4096),
            ("ce", 5, 2048),
            ("replicated", 1, 8192),
            ("replicated", 13, 4096),
        ]
        if scenario == "correct"
        else [(os.environ.get("MP_ALGO", "one_shot"), 4, 4096)]
    )
    for algo, tokens, hidden in cases:
        replicated = algo == "replicated"
        q = tokens if replicated else ceil_div(tokens, nproc)
        partial = rng.standard_normal((nproc, tokens, hidden)).astype(ml_dtypes.bfloat16)
        residual = rng.standard_normal((nproc, q, hidden)).astype(ml_dtypes.bfloat16)
        weight = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        if replicated:  # every process's copy the same rows
            residual[:] = residual[0]
            reason = _ffi.replicated_reason(mesh, "tp", jax.numpy.bfloat16, (tokens, hidden))
        else:
            reason = comm.unavailable_reason(jax.numpy.bfloat16, (tokens, hidden), algo=algo)
        assert reason is None, reason
        normed, res_out = _run(mesh, partial, residual, weight, algo)
        want_n, want_r = reference(partial, residual, weight, residual_replicated=replicated)
        err = float(np.linalg.norm(normed - want_n) / np.linalg.norm(want_n))
        err_r = float(np.linalg.norm(res_out - want_r[rank]) / np.linalg.norm(want_r[rank]))
        result[f"{algo}/{tokens}/{hidden}"] = {
            "rel_err": err,
            "rel_err_residual": err_r,
            "normed_sum": float(normed.astype(np.float64).sum()),
        }
        if scenario == "correct":
            continue
        if rank == nproc - 1:  # the missing peer
            sys.stdout.flush()
            if scenario == "kill":
                os._exit(0)
            time.sleep(3 * comm.settings.timeout_s)
            break
        start = time.perf_counter()
        normed, _ = _run(mesh, partial, residual, weight, algo)  # the peer never joins
        try:
            comm.check()
            result["error"] = None
        except CommFailed as err:
            result["error"] = str(err)
        result["seconds"] = time.perf_counter() - start
        result["nan_outputs"] = bool(np.isnan(normed).all())
    with open(out, "w") as f:
        json.dump(result, f)
    if scenario != "correct":  # jax.distributed's exit barrier would wait for the lost peer
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
