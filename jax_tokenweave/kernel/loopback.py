"""The loopback harness from Python: every rank of an N-rank group on ONE GPU (see
``ffi/collective/loopback.h``). It runs the real fused kernels and their device-resident protocol,
so the protocol for N in {1, 2, 4, 8} is tested where a single GPU is at hand. Its timings compare
variants' fixed costs only: "peer" memory is local memory here, not NVLink.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_tokenweave.kernel import _extension
from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.kernel.comm import CommSettings

_NUMPY = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


@dataclasses.dataclass
class LoopbackResult:
    """Outputs after the last call: normed [N, T, H] and residual_out [N, q, H] ([N, T, H] for
    a replicated residual), in the dtype's NumPy type; output vectors of later calls/replays
    that differed from call 0, per-replay device time of one call (us), and the communicator's
    failure message (or None)."""

    normed: np.ndarray
    residual_out: np.ndarray
    mismatches: int
    call_us: list[float]
    error: str | None


class LoopbackComm:
    """A communicator whose ``num_ranks`` ranks all live on CUDA device ``ordinal``."""

    def __init__(self, num_ranks: int, settings: CommSettings | None = None, ordinal: int = 0):
        s = settings or CommSettings(workspace_mib=256, oneshot_mib=8, num_slots=2)
        self.num_ranks, self.settings = num_ranks, s
        self.comm_id = _extension.get().register_comm(
            [ordinal] * num_ranks,
            num_ranks,
            s.area_bytes,
            s.oneshot_bytes,
            s.num_slots,
            s.timeout_s,
            False,
            True,
        )

    def run(
        self,
        partial: np.ndarray,
        residual: np.ndarray,
        weight: np.ndarray,
        *,
        algo: str = "one_shot",
        num_ctas: int = 8,
        eps: float = 1e-6,
        calls: int = 1,
        slots: int = 1,
        skip_call: int = -1,
        skip_rank: int = 0,
        graph_calls: int = 0,
        graph_replays: int = 0,
        free_running: bool = False,
        residual_replicated: bool = False,
    ) -> LoopbackResult:
        """``calls`` back-to-back fused calls of every rank on ``partial`` [N, T, H] and the
        token-sharded ``residual`` [N, q, H] (bf16/fp16/fp32 NumPy arrays) with float32
        ``weight`` [H]; then, optionally, ``graph_replays`` timed replays of a CUDA graph of
        ``graph_calls`` calls (``free_running``: each rank's calls back to back, forked and
        joined once, not per call). ``skip_call``: the call at which rank ``skip_rank`` is
        absent. ``residual_replicated``: ``residual`` is every rank's whole copy [N, T, H] (the
        decode one-shot kernel only; ``reference`` wants each rank's copy the same)."""
        if algo == "ce":
            raise ValueError(
                "the loopback harness runs the SM kernels only: algo='ce' needs a GPU per rank "
                "(its transfers are copy-engine copies between devices)"
            )
        n, tokens, hidden = partial.shape
        dtype = jnp.dtype(partial.dtype).name
        if n != self.num_ranks or residual.dtype != partial.dtype:
            raise ValueError("partial must be [N, T, H] for this comm's N, residual its dtype")
        rows = tokens if residual_replicated else ceil_div(tokens, n)
        if residual.shape != (n, rows, hidden):
            layout = "replicated" if residual_replicated else "token-sharded"
            raise ValueError(
                f"a {layout} residual must be {(n, rows, hidden)}, got {residual.shape}"
            )
        out = _extension.get().loopback_run(
            self.comm_id,
            dtype,
            algo,
            num_ctas,
            tokens,
            hidden,
            eps,
            np.ascontiguousarray(partial).tobytes(),
            np.ascontiguousarray(residual).tobytes(),
            np.ascontiguousarray(weight, np.float32).tobytes(),
            calls,
            slots,
            skip_call,
            skip_rank,
            graph_calls,
            graph_replays,
            free_running,
            residual_replicated,
        )
        np_dtype = _NUMPY[dtype]
        return LoopbackResult(
            normed=np.frombuffer(out["normed"], np_dtype).reshape(n, tokens, hidden),
            residual_out=np.frombuffer(out["residual_out"], np_dtype).reshape(n, -1, hidden),
            mismatches=int(out["mismatches"]),
            call_us=list(out["call_us"]),
            error=out["error"],
        )

    def failure(self) -> str | None:
        return _extension.get().failure_message(self.comm_id)

    def close(self) -> None:
        """Frees the workspace (waits for the device first)."""
        _extension.get().release_comm(self.comm_id)


def reference(
    partial: np.ndarray,
    residual: np.ndarray,
    weight: np.ndarray,
    eps: float = 1e-6,
    *,
    residual_replicated: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Float64 ``(normed [T, H], residual_out [N, q, H])`` of the fused op for loopback inputs
    (padding rows past T carry the residual through). ``residual_replicated``: ``residual`` is
    [N, T, H] with every rank's copy the same; residual_out is then [N, T, H]."""
    n, tokens, hidden = partial.shape
    total = partial.astype(np.float64).sum(0)
    if residual_replicated:
        x = residual[0].astype(np.float64) + total
        res_out = np.repeat(x[None], n, axis=0)
    else:
        q = residual.shape[1]
        summed = np.zeros((n * q, hidden))
        summed[:tokens] = total
        res_out = residual.astype(np.float64).reshape(n * q, hidden) + summed
        x = res_out[:tokens]
        res_out = res_out.reshape(n, q, hidden)
    normed = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight.astype(np.float64)
    return normed, res_out
