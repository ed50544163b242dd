// The kernels of the copy-engine call (ce_plan.h has the protocol; ce_call.cc issues it): the
// wait (one warp polls its peers' flags, bounded and reported like every other wait), the reduce
// kernel, the call's only SM work beyond that warp while the data moves by copy engine, and the
// finish kernel, which leaves NaN in every output when the group failed during the call (a wait
// gave up: the copies that followed carried nothing meaningful).
//
// Reduce: own rows g = r*q + row (row < q). Sources in rank order: this rank's `partial` row g,
// or the peer's slice PeerIndex(src, r) of this rank's staging area; then the residual row.
// The rounded sum goes to residual_out, the normed row to `normed` row g and to this rank's own
// staging slice (N-1), which the peers pull. Rows past T (the last owner's padding) carry the
// residual through. Same arithmetic and order as every other variant, so ranks agree bitwise.
#include "ce_plan.h"
#include "rowops.cuh"

namespace tokenweave {
namespace {

constexpr int kGroup = 128;  // threads per row: 4 rows per 512-thread block at once
constexpr int kGroups = kThreads / kGroup;
constexpr int kFinishCtas = 8;

// Block 0 counts the call (timeout reports say how far each rank's reduce kernels got).
__device__ __forceinline__ void CountCall(const KernelParams& p) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    SlotControl* c = p.ctl[p.rank];
    StVolatile(&c->ce_calls, LdVolatile(&c->ce_calls) + 1);
  }
}

// Lane k-1 waits for peer (rank + k)'s flag of `phase` and clears it. Past the bound it reports
// (ReportTimeout: the group fails, later kernels poison); a failed group ends it at once.
__global__ void __launch_bounds__(32)
    CeWaitKernel(const __grid_constant__ KernelParams p, int phase) {
  const int k = threadIdx.x + 1;
  if (k >= p.nranks) return;
  const int peer = (p.rank + k) % p.nranks;
  uint32_t* flag = p.ce_flags[p.rank] + CeFlagIndex(phase, peer);
  Deadline d;
  uint32_t seen;
  while ((seen = LoadAcquire(flag)) != 1u) {
    const Deadline::Result r = d.Tick(p);
    if (r == Deadline::kWait) continue;
    if (r == Deadline::kExpired) {
      const uint32_t calls = LdVolatile(&p.ctl[p.rank]->ce_calls);
      ReportTimeout(p, phase == 0 ? kStageCeScatter : kStageCeGather, peer, -1,
                    phase == 0 ? calls + 1 : calls, seen, &p.ctl[peer]->ce_calls);
    }
    break;
  }
  StVolatile(flag, 0);
}

// A call whose launch gate expired (launch_gate.h) reports like an expired wait.
__global__ void __launch_bounds__(32)
    GateTimeoutKernel(const __grid_constant__ KernelParams p, int peer, uint32_t call,
                      uint32_t peer_calls) {
  if (threadIdx.x == 0) ReportFailure(p, kStageLaunchGate, peer, -1, call, 0, peer_calls);
}

template <typename T>
__device__ __forceinline__ void PoisonRows(char* base, int64_t rows, int64_t rb) {
  const uint4 nan = NanVec<T>();
  const int64_t vectors = rows * rb / 16;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vectors;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    St(base + i * 16, nan);
}

template <typename T, int kMaxN>
__global__ void __launch_bounds__(kThreads) CeReduceKernel(const __grid_constant__ KernelParams p) {
  __shared__ float red[kThreads / 32];
  __shared__ int failed;
  CountCall(p);
  if (threadIdx.x == 0) failed = GroupFailed(p) ? 1 : 0;
  __syncthreads();
  const int group = threadIdx.x / kGroup;
  const int n = p.nranks, r = p.rank, q = p.rows, tokens = p.tokens;
  const int vpr = p.hidden / Vec<T>::kN;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  char* own_slice = p.ce[r] + (n - 1) * q * rb;
  if (failed) {  // peers that pull our slice get NaN too
    PoisonRows<T>(own_slice, q, rb);
    PoisonRows<T>(static_cast<char*>(p.residual_out), q, rb);
    return;
  }
  const char* partial = static_cast<const char*>(p.partial);
  const char* residual = static_cast<const char*>(p.residual);
  char* normed = static_cast<char*>(p.normed);
  char* residual_out = static_cast<char*>(p.residual_out);
  for (int row = blockIdx.x * kGroups + group; row < q; row += gridDim.x * kGroups) {
    const int g = r * q + row;
    const char* res_in = residual + row * rb;
    if (g >= tokens) {
      CopyRow<kGroup>(res_in, residual_out + row * rb, vpr);
      continue;
    }
    const char* rows[kMaxN + 1];  // the N partials in rank order, then the residual
    StagedSources<kMaxN>(rows, n, r, partial, p.ce[r], res_in, q, row, rb);
    char* slice_row = own_slice + row * rb;
    // The rounded sum is staged in residual_out itself (written once, read back from L2).
    FusedRow<T, kGroup, kURows<kMaxN>, false>(
        p,
        [&](int v0, float(*acc)[Vec<T>::kN]) {
          LoadSum<T, kGroup, kMaxN + 1, kURows<kMaxN>>(acc, rows, n + 1, v0, vpr);
        },
        nullptr, residual_out + row * rb,
        [&](int v, uint4 o) {
          St(normed + g * rb + v * 16, o);
          St(slice_row + v * 16, o);
        },
        red, group);
  }
}

// NaN in both outputs when the group failed; otherwise nothing (one load per block).
template <typename T>
__global__ void __launch_bounds__(kThreads) CeFinishKernel(const __grid_constant__ KernelParams p) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = GroupFailed(p) ? 1 : 0;
  __syncthreads();
  if (!failed) return;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  PoisonRows<T>(static_cast<char*>(p.normed), p.tokens, rb);
  PoisonRows<T>(static_cast<char*>(p.residual_out), p.rows, rb);
}

template <typename T>
cudaError_t Reduce(const KernelParams& p, int num_ctas, cudaStream_t stream) {
  static_assert(kMaxRanks == 8, "CeReduceKernel instances cover groups of up to 8 ranks");
  if (p.nranks <= 2)
    CeReduceKernel<T, 2><<<num_ctas, kThreads, 0, stream>>>(p);
  else if (p.nranks <= 4)
    CeReduceKernel<T, 4><<<num_ctas, kThreads, 0, stream>>>(p);
  else
    CeReduceKernel<T, 8><<<num_ctas, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t PreloadFor() {
  cudaFuncAttributes a;
  const void* kernels[] = {reinterpret_cast<const void*>(CeReduceKernel<T, 2>),
                           reinterpret_cast<const void*>(CeReduceKernel<T, 4>),
                           reinterpret_cast<const void*>(CeReduceKernel<T, 8>),
                           reinterpret_cast<const void*>(CeFinishKernel<T>)};
  for (const void* k : kernels)
    if (cudaError_t e = cudaFuncGetAttributes(&a, k); e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchCeReduce(const KernelParams& p, DType dtype, int num_ctas, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32: return Reduce<float>(p, num_ctas, stream);
    case DType::kF16: return Reduce<__half>(p, num_ctas, stream);
    case DType::kBF16: return Reduce<__nv_bfloat16>(p, num_ctas, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchCeFinish(const KernelParams& p, DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32: CeFinishKernel<float><<<kFinishCtas, kThreads, 0, stream>>>(p); break;
    case DType::kF16: CeFinishKernel<__half><<<kFinishCtas, kThreads, 0, stream>>>(p); break;
    case DType::kBF16:
      CeFinishKernel<__nv_bfloat16><<<kFinishCtas, kThreads, 0, stream>>>(p);
      break;
  }
  return cudaGetLastError();
}

cudaError_t LaunchCeWait(const KernelParams& p, int phase, cudaStream_t stream) {
  CeWaitKernel<<<1, 32, 0, stream>>>(p, phase);
  return cudaGetLastError();
}

// The finish kernel doubles as the poison: the report above has marked the group failed.
cudaError_t LaunchGateTimeout(const KernelParams& p, DType dtype, int peer, uint32_t call,
                              uint32_t peer_calls, cudaStream_t stream) {
  GateTimeoutKernel<<<1, 32, 0, stream>>>(p, peer, call, peer_calls);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return LaunchCeFinish(p, dtype, stream);
}

cudaError_t PreloadCeKernels() {
  cudaFuncAttributes a;
  for (const void* k : {reinterpret_cast<const void*>(CeWaitKernel),
                        reinterpret_cast<const void*>(GateTimeoutKernel)})
    if (cudaError_t e = cudaFuncGetAttributes(&a, k); e != cudaSuccess) return e;
  for (cudaError_t e : {PreloadFor<float>(), PreloadFor<__half>(), PreloadFor<__nv_bfloat16>()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace tokenweave
