// The fused call of a group of one rank (N = 1): nothing to communicate, so no call state, no
// receive buffers, no waits: residual_out = partial + residual (rounded to T), normed =
// RMSNorm(residual_out) * weight, one 512-thread block per row (grid-stride over rows), the
// row in registers while it fits (H x itemsize <= 16 KiB). Same arithmetic as every other
// variant: the sum in float32 in the order partial, residual.
//
// Why a kernel of its own: the protocol kernels pay the slot's state atomic, the end-of-call
// advance and their code size even when N = 1 (4.05 us per call at T = 1 on an H200 against
// 2.18 us for a minimal add + norm, benchmarks/results/2026-11-23-h200x1/fixed_cost.md; 2.47
// us with this kernel, benchmarks/results/2026-11-24-h200x1). A group of one never waits and
// no peer reads its slot state, so skipping the state is safe: every call of a one-rank comm
// takes this path (a closed comm still leaves NaN, below).
#include "rowops.cuh"

namespace tokenweave {
namespace {

constexpr int kMaxLocalGrid = 4096;  // blocks at most; more rows are taken grid-stride

// kBlock threads per row, kU 16-byte vectors per thread: rowops' FusedRow, one pass with the
// row in registers while vpr <= kBlock * kU, two passes beyond. The comm's failure word is
// loaded first and looked at last (its latency hides behind the row's): a comm closed since a
// command buffer recorded this call leaves NaN, as every other variant does.
template <typename T, int kBlock, int kU>
__global__ void __launch_bounds__(kBlock) LocalRowsKernel(const __grid_constant__ KernelParams p) {
  __shared__ float red[kBlock / 32];
  const uint32_t failed = LdVolatile(&p.rank_ctl[0]->failed);
  const int vpr = p.hidden / Vec<T>::kN;
  const int64_t rb = static_cast<int64_t>(p.hidden) * sizeof(T);
  for (int row = blockIdx.x; row < p.tokens; row += gridDim.x) {
    const char* rows[2] = {static_cast<const char*>(p.partial) + row * rb,
                           static_cast<const char*>(p.residual) + row * rb};
    char* normed = static_cast<char*>(p.normed) + row * rb;
    char* residual_out = static_cast<char*>(p.residual_out) + row * rb;
    FusedRow<T, kBlock, kU, true>(
        p,
        [&](int v0, float(*acc)[Vec<T>::kN]) {  // partial, then residual, all loads in flight
          LoadSum<T, kBlock, 2, kU>(acc, rows, 2, v0, vpr);
        },
        residual_out, normed, [&](int v, uint4 o) { St(normed + v * 16, o); }, red, 0);
    if (failed != 0) {
      __syncthreads();  // after every thread's stores of the row
      for (int v = threadIdx.x; v < vpr; v += kBlock) {
        St(normed + v * 16, NanVec<T>());
        St(residual_out + v * 16, NanVec<T>());
      }
    }
  }
}

constexpr int kLocalBlock = kThreads, kLocalU = 2;  // rows of 8192 bf16 in registers

template <typename T>
cudaError_t LaunchFor(const KernelParams& p, cudaStream_t stream) {
  const int grid = p.tokens < kMaxLocalGrid ? p.tokens : kMaxLocalGrid;
  LocalRowsKernel<T, kLocalBlock, kLocalU><<<grid, kLocalBlock, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchLocalRows(const KernelParams& p, DType dtype, cudaStream_t stream) {
  if (p.nranks != 1 || p.tokens < 1 || p.rows != p.tokens) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kF32: return LaunchFor<float>(p, stream);
    case DType::kF16: return LaunchFor<__half>(p, stream);
    case DType::kBF16: return LaunchFor<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t PreloadLocalRowsKernels() {
  cudaFuncAttributes a;
  for (const void* k :
       {reinterpret_cast<const void*>(LocalRowsKernel<float, kLocalBlock, kLocalU>),
        reinterpret_cast<const void*>(LocalRowsKernel<__half, kLocalBlock, kLocalU>),
        reinterpret_cast<const void*>(LocalRowsKernel<__nv_bfloat16, kLocalBlock, kLocalU>)})
    if (cudaError_t e = cudaFuncGetAttributes(&a, k); e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace tokenweave
